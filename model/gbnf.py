"""GBNF grammars parsed as llama.cpp parses them (src/llama-grammar.cpp, `llama_grammar_parser` and
`llama_grammar_init_impl`): the same rules, the same symbol ids, the same refusals.

`parse_gbnf(text)` returns the rules (each a list of (type, value) elements ending in END) and the
symbol table, or raises `GrammarError` where llama.cpp's grammar sampler would fail to build: a
syntax error, an undefined rule, no `root`, left recursion, repetitions over the sane limit, or a
`<token>` that is not exactly one token. `check_llguidance_size(text)` raises `GrammarTooLarge` for a
grammar llama.cpp parses and llguidance (which constrains our decoding) would fail on later: a rule of
more alternatives than its parser holds in a row fails mid-decode, and a chain of thousands of rules
overflows its compile's stack and ends the process. Both are refused by name before any model work. The request path uses it to answer an unparsable grammar as
llama-server does ("failed to parse grammar"); constrained sampling itself builds on these rules.
"""

from __future__ import annotations

from collections.abc import Callable

END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = range(10)
MAX_REPETITION_THRESHOLD = 2000
UINT64_MAX = (1 << 64) - 1


# llama.cpp's parser recurses once per nested group on the C stack; ours would reach Python's recursion
# limit near 450 levels and fail with a RecursionError, so it stops well before, with a reason.
MAX_NESTING = 256


class GrammarError(ValueError):
    pass


class GrammarTooDeep(GrammarError):
    """Parentheses nested deeper than MAX_NESTING: llama.cpp would parse it; we refuse it by name."""


# llguidance's Earley parser holds at most 2000 items in a row (ParserLimits.max_items_in_row, the
# default model/constraint.py keeps): one rule's alternatives, all predicted at once, take one each, and
# its start rule one more ("Current row has 2001 items; max is 2000", after the first token)
MAX_ITEMS_IN_ROW = 2000
MAX_ALTERNATIVES = MAX_ITEMS_IN_ROW - 1
# rules a grammar defines: llguidance's compile recursed past an 8 MiB stack (a segfault) on a chain of
# 4,000 rules; real grammars define tens to hundreds
MAX_RULES = 1000


class GrammarTooLarge(GrammarError):
    """More rules or alternatives than llguidance takes: llama.cpp would parse it; we refuse it by name."""


def _is_digit(c: int) -> bool:
    return 0x30 <= c <= 0x39


def _is_word(c: int) -> bool:
    return 0x61 <= c <= 0x7A or 0x41 <= c <= 0x5A or c == 0x2D or _is_digit(c)


class _Parser:
    def __init__(self, src: bytes, tokenize: Callable[[str], list[int]] | None):
        self.s = src.split(b"\0", 1)[0] + b"\0"  # a C string: it ends at the first NUL
        self.tokenize = tokenize
        self.symbol_ids: dict[str, int] = {}
        self.rules: list[list[tuple[int, int]]] = []
        self.depth = 0  # groups open at this point of the parse
        self.defined = 0  # rules the text defines (`name ::= ...`), not the ones groups make

    def at(self, i: int) -> int:
        return self.s[i] if i < len(self.s) else 0

    def rest(self, i: int) -> str:
        return self.s[i:-1].decode("utf-8", "replace")

    # --- lexical -----------------------------------------------------------------------------

    def space(self, i: int, newline_ok: bool) -> int:
        while True:
            c = self.at(i)
            if c == 0x23:  # '#': a comment to the end of the line
                while self.at(i) not in (0, 0x0D, 0x0A):
                    i += 1
            elif c in (0x20, 0x09) or (newline_ok and c in (0x0D, 0x0A)):
                i += 1
            else:
                return i

    def name(self, i: int) -> int:
        j = i
        while _is_word(self.at(j)):
            j += 1
        if j == i:
            raise GrammarError(f"expecting name at {self.rest(i)}")
        return j

    def int_end(self, i: int) -> int:
        j = i
        while _is_digit(self.at(j)):
            j += 1
        if j == i:
            raise GrammarError(f"expecting integer at {self.rest(i)}")
        return j

    def hex(self, i: int, size: int) -> tuple[int, int]:
        value, j = 0, i
        while j < i + size and self.at(j):
            c = chr(self.at(j))
            if c not in "0123456789abcdefABCDEF":
                break
            value = (value << 4) + int(c, 16)
            j += 1
        if j != i + size:
            raise GrammarError(f"expecting {size} hex chars at {self.rest(i)}")
        return value & 0xFFFFFFFF, j

    def char(self, i: int) -> tuple[int, int]:
        c = self.at(i)
        if c == 0x5C:  # backslash
            e = chr(self.at(i + 1))
            if e in "xuU":
                return self.hex(i + 2, {"x": 2, "u": 4, "U": 8}[e])
            if e in "trn":
                return {"t": 9, "r": 13, "n": 10}[e], i + 2
            if e in '\\"[]-':
                return ord(e), i + 2
            raise GrammarError(f"unknown escape at {self.rest(i)}")
        if c:
            n = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[c >> 4]
            value, j = c & ((1 << (8 - n)) - 1), i + 1
            while j < i + n and self.at(j):
                value = (value << 6) + (self.at(j) & 0x3F)
                j += 1
            return value, j
        raise GrammarError("unexpected end of input")

    def token(self, i: int) -> tuple[int, int]:
        if self.at(i) != 0x3C:
            raise GrammarError(f"expecting '<' at {self.rest(i)}")
        j = i + 1
        if self.at(j) == 0x5B:  # <[id]>
            end = self.int_end(j + 1)
            tid = int(self.s[j + 1:end])
            if tid > 0xFFFFFFFF:
                raise GrammarError(f"parsed token id is too big at {self.rest(j + 1)}")
            if self.at(end) != 0x5D or self.at(end + 1) != 0x3E:
                raise GrammarError(f"expecting ']' or '>' at {self.rest(end)}")
            return tid, end + 2
        if self.tokenize is None:
            raise GrammarError(f"no vocab to parse token at {self.rest(i)}")
        while self.at(j) not in (0, 0x3E):
            j += 1
        if self.at(j) != 0x3E:
            raise GrammarError(f"expecting '>' at {self.rest(j)}")
        ids = self.tokenize(self.s[i:j + 1].decode("utf-8", "replace"))
        if len(ids) != 1:
            raise GrammarError(f"invalid token '{self.s[i:j + 1].decode('utf-8', 'replace')}'")
        return ids[0], j + 1

    # --- rules -------------------------------------------------------------------------------

    def symbol(self, name: str) -> int:
        return self.symbol_ids.setdefault(name, len(self.symbol_ids))

    def generate(self, base: str) -> int:
        next_id = len(self.symbol_ids)
        self.symbol_ids[f"{base}_{next_id}"] = next_id
        return next_id

    def add_rule(self, rule_id: int, rule: list[tuple[int, int]]) -> None:
        while len(self.rules) <= rule_id:
            self.rules.append([])
        self.rules[rule_id] = rule

    def alternates(self, i: int, rule_name: str, rule_id: int, nested: bool) -> int:
        rule: list[tuple[int, int]] = []
        i = self.sequence(i, rule_name, rule, nested)
        while self.at(i) == 0x7C:  # '|'
            rule.append((ALT, 0))
            i = self.sequence(self.space(i + 1, True), rule_name, rule, nested)
        rule.append((END, 0))
        self.add_rule(rule_id, rule)
        return i

    def sequence(self, i: int, rule_name: str, rule: list, nested: bool) -> int:  # noqa: C901 (one port)
        last = len(rule)
        n_prev = 1

        def repeat(lo: int, hi: int) -> None:
            nonlocal n_prev
            no_max = hi == UINT64_MAX
            if last == len(rule):
                raise GrammarError(f"expecting preceding item to */+/?/{{ at {self.rest(i)}")
            prev = rule[last:]
            total = hi if not no_max and hi > 0 else lo if lo > 0 else 1
            if n_prev * total > MAX_REPETITION_THRESHOLD:
                raise GrammarError("number of rules that are going to be repeated multiplied by the new "
                                   "repetition exceeds sane defaults")
            if lo == 0:
                del rule[last:]
            else:
                for _ in range(1, lo):
                    rule.extend(prev)
            last_rec = 0
            n_opt = 1 if no_max else hi - lo
            for k in range(n_opt):
                rec = list(prev)
                rec_id = self.generate(rule_name)
                if k > 0 or no_max:
                    rec.append((RULE_REF, rec_id if no_max else last_rec))
                rec += [(ALT, 0), (END, 0)]
                self.add_rule(rec_id, rec)
                last_rec = rec_id
            if n_opt > 0:
                rule.append((RULE_REF, last_rec))
            n_prev *= total

        while self.at(i):
            c = self.at(i)
            if c == 0x22:  # "literal"
                i += 1
                last, n_prev = len(rule), 1
                while self.at(i) != 0x22:
                    if not self.at(i):
                        raise GrammarError("unexpected end of input")
                    ch, i = self.char(i)
                    rule.append((CHAR, ch))
                i = self.space(i + 1, nested)
            elif c == 0x5B:  # [ranges]
                i += 1
                start = CHAR
                if self.at(i) == 0x5E:
                    i, start = i + 1, CHAR_NOT
                last, n_prev = len(rule), 1
                while self.at(i) != 0x5D:
                    if not self.at(i):
                        raise GrammarError("unexpected end of input")
                    ch, i = self.char(i)
                    rule.append((CHAR_ALT if last < len(rule) else start, ch))
                    if self.at(i) == 0x2D and self.at(i + 1) != 0x5D:
                        if not self.at(i + 1):
                            raise GrammarError("unexpected end of input")
                        ch, i = self.char(i + 1)
                        rule.append((CHAR_RNG_UPPER, ch))
                i = self.space(i + 1, nested)
            elif c in (0x3C, 0x21):  # <token> or !<token>
                kind = TOKEN
                if c == 0x21:
                    i, kind = i + 1, TOKEN_NOT
                tid, i = self.token(i)
                last, n_prev = len(rule), 1
                rule.append((kind, tid))
                i = self.space(i, nested)
            elif _is_word(c):
                end = self.name(i)
                ref = self.symbol(self.s[i:end].decode())
                i = self.space(end, nested)
                last, n_prev = len(rule), 1
                rule.append((RULE_REF, ref))
            elif c == 0x28:  # (group)
                if self.depth >= MAX_NESTING:
                    raise GrammarTooDeep(f"groups nested deeper than {MAX_NESTING} levels")
                i = self.space(i + 1, True)
                before = len(self.symbol_ids)
                sub = self.generate(rule_name)
                self.depth += 1
                i = self.alternates(i, rule_name, sub, True)
                self.depth -= 1
                n_prev = max(1, len(self.symbol_ids) - before)
                last = len(rule)
                rule.append((RULE_REF, sub))
                if self.at(i) != 0x29:
                    raise GrammarError(f"expecting ')' at {self.rest(i)}")
                i = self.space(i + 1, nested)
            elif c == 0x2E:  # .
                last, n_prev = len(rule), 1
                rule.append((CHAR_ANY, 0))
                i = self.space(i + 1, nested)
            elif c in (0x2A, 0x2B, 0x3F):  # * + ?
                i = self.space(i + 1, nested)
                repeat(*{0x2A: (0, UINT64_MAX), 0x2B: (1, UINT64_MAX), 0x3F: (0, 1)}[c])
            elif c == 0x7B:  # {m,n}
                i = self.space(i + 1, nested)
                if not _is_digit(self.at(i)):
                    raise GrammarError(f"expecting an int at {self.rest(i)}")
                end = self.int_end(i)
                lo, hi = int(self.s[i:end]), UINT64_MAX
                i = self.space(end, nested)
                if self.at(i) == 0x7D:
                    hi = lo
                    i = self.space(i + 1, nested)
                elif self.at(i) == 0x2C:
                    i = self.space(i + 1, nested)
                    if _is_digit(self.at(i)):
                        end = self.int_end(i)
                        hi = int(self.s[i:end])
                        i = self.space(end, nested)
                    if self.at(i) != 0x7D:
                        raise GrammarError(f"expecting '}}' at {self.rest(i)}")
                    i = self.space(i + 1, nested)
                else:
                    raise GrammarError(f"expecting ',' at {self.rest(i)}")
                if lo > MAX_REPETITION_THRESHOLD:
                    raise GrammarError("number of repetitions exceeds sane defaults")
                if hi != UINT64_MAX and hi > MAX_REPETITION_THRESHOLD:
                    hi = UINT64_MAX
                repeat(lo, hi)
            else:
                break
        return i

    def rule(self, i: int) -> int:
        end = self.name(i)
        name = self.s[i:end].decode()
        rule_id = self.symbol(name)
        self.defined += 1
        i = self.space(end, False)
        if self.s[i:i + 3] != b"::=":
            raise GrammarError(f"expecting ::= at {self.rest(i)}")
        i = self.alternates(self.space(i + 3, True), name, rule_id, False)
        if self.at(i) == 0x0D:
            i += 2 if self.at(i + 1) == 0x0A else 1
        elif self.at(i) == 0x0A:
            i += 1
        elif self.at(i):
            raise GrammarError(f"expecting newline or end at {self.rest(i)}")
        return self.space(i, True)


def parse_gbnf(text: str, root: str = "root",
               tokenize: Callable[[str], list[int]] | None = None) -> tuple[list[list[tuple[int, int]]], dict[str, int]]:
    """Rules and symbol ids of a GBNF grammar; `GrammarError` where llama.cpp refuses it.

    `tokenize(text)` resolves `<token>` elements (parse_special, no BOS); without it they are refused.
    """
    p = _parse(text, root, tokenize)
    _check_left_recursion(p.rules)
    return p.rules, p.symbol_ids


def check_llguidance_size(text: str) -> None:
    """`GrammarTooLarge` for a grammar (one `parse_gbnf` takes) past what llguidance takes."""
    p = _parse(text, "root", None)
    if p.defined > MAX_RULES:
        raise GrammarTooLarge(f"{p.defined} rules, more than {MAX_RULES}")
    for rule in p.rules:  # a group's alternatives are a rule of their own here, as in llguidance's grammar
        alternatives = 1 + sum(1 for kind, _ in rule if kind == ALT)
        if alternatives > MAX_ALTERNATIVES:
            raise GrammarTooLarge(f"a rule of {alternatives} alternatives, more than {MAX_ALTERNATIVES} (llguidance's "
                                  f"parser holds {MAX_ITEMS_IN_ROW} items at a position)")


def _parse(text: str, root: str, tokenize: Callable[[str], list[int]] | None) -> _Parser:
    p = _Parser(text.encode("utf-8", "surrogatepass"), tokenize)
    i = p.space(0, True)
    try:
        while p.at(i):
            i = p.rule(i)
    except RecursionError:  # MAX_NESTING fits Python's default limit; a caller deep in its stack may not
        raise GrammarTooDeep("groups nested too deeply for this server's stack") from None
    for rule in p.rules:
        if not rule:
            raise GrammarError("Undefined rule")
        for kind, value in rule:
            if kind == RULE_REF and (value >= len(p.rules) or not p.rules[value]):
                name = next(k for k, v in p.symbol_ids.items() if v == value)
                raise GrammarError(f"Undefined rule identifier '{name}'")
    if not p.rules:
        raise GrammarError("the grammar is empty")
    if root not in p.symbol_ids:
        raise GrammarError(f"grammar does not contain a '{root}' symbol")
    return p


def _check_left_recursion(rules: list[list[tuple[int, int]]]) -> None:
    """llama_grammar_detect_left_recursion, walked with an explicit stack: a chain of thousands of rules
    must not exhaust Python's. A rule whose walk finished without finding a cycle is not walked again
    (llama.cpp walks it again, which changes nothing but the time: exponential on a diamond of rules)."""
    n = len(rules)
    visited, in_progress, may_be_empty = [False] * n, [False] * n, [False] * n

    def enter(k: int) -> None:
        in_progress[k] = True
        at_start = True
        for kind, _ in rules[k]:
            if kind in (END, ALT):
                if at_start:
                    may_be_empty[k] = True
                    break
                at_start = True
            else:
                at_start = False

    def detect(root: int) -> bool:
        enter(root)
        stack = [[root, 0, True]]  # rule, next element, whether a reference there is at its start
        while stack:
            frame = stack[-1]
            k, pos, recurse = frame
            rule = rules[k]
            if pos == len(rule):
                in_progress[k] = False
                visited[k] = True
                stack.pop()
                if stack:  # the caller goes on past its reference to k
                    parent = stack[-1]
                    parent[2] = parent[2] and may_be_empty[k]
                continue
            kind, value = rule[pos]
            frame[1] = pos + 1
            if kind == RULE_REF and recurse:
                if in_progress[value]:
                    return True
                if visited[value]:
                    frame[2] = may_be_empty[value]
                else:
                    enter(value)
                    stack.append([value, 0, True])
            elif kind in (END, ALT):
                frame[2] = True
            else:
                frame[2] = False
        return False

    for k in range(n):
        if not visited[k] and detect(k):
            raise GrammarError(f"unsupported grammar, left recursion detected for nonterminal at index {k}")
