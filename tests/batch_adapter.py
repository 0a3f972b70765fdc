"""The engine thread's batch protocol (model.engine_thread.BatchEngine) over the tests' generator
engines (the fake engine, the replay engine): up to `max_seqs` generations, admitted first come first
served, each advanced one step per iteration. An exception in one generation ends that request alone
with an error; a BaseException goes on up and kills the engine thread, as a real one would."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from model.engine_thread import _why
from model.messages import EngineStats, FinishReason, GenerateRequest, Iteration, SamplingParams, StepOutput


class GeneratorBatch:
    max_seqs = 1

    def __init__(self):
        self._waiting: deque[tuple[int, GenerateRequest]] = deque()
        self._running: dict[int, tuple[GenerateRequest, Iterator[StepOutput], list[int]]] = {}
        self._next_task = 0

    def generate(self, prompt_tokens: list[int], params: SamplingParams | None = None,
                 request_id: str = "generate") -> Iterator[StepOutput]:
        raise NotImplementedError

    def add(self, request: GenerateRequest) -> int:
        task, self._next_task = self._next_task, self._next_task + 1
        self._waiting.append((task, request))
        return task

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def iterate(self) -> Iteration:
        it = Iteration()
        while self._waiting and len(self._running) < self.max_seqs:
            task, request = self._waiting.popleft()
            steps = self.generate(request.prompt_tokens, request.params, request.request_id or "generate")
            self._running[task] = (request, steps, [0])
            it.admitted.append((task, time.perf_counter()))
        for task, (request, steps, count) in list(self._running.items()):
            try:
                out = next(steps)
            except StopIteration:
                out = _error(request, "the engine ended the generation without a finish reason")
            except Exception as e:
                out = _error(request, _why(e))
            count[0] = out.completion_tokens
            if out.finish_reason is not None:
                del self._running[task]
                steps.close()
            it.outputs.append((task, out))
        return it

    def cancel(self, task: int) -> StepOutput | None:
        for i, (t, request) in enumerate(self._waiting):
            if t == task:
                del self._waiting[i]
                return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=len(request.prompt_tokens))
        if task in self._running:
            request, steps, count = self._running.pop(task)
            steps.close()
            return StepOutput(token=None, finish_reason=FinishReason.ABORT, prompt_tokens=len(request.prompt_tokens),
                              completion_tokens=count[0])
        return None

    def reset(self) -> list[int]:
        dropped = list(self._running)
        for _, steps, _ in self._running.values():
            steps.close()
        self._running.clear()
        return dropped

    def free_slots(self) -> int:
        return self.max_seqs - len(self._running)

    def stats(self) -> EngineStats:
        return EngineStats(max_seqs=self.max_seqs, running=len(self._running), waiting=len(self._waiting))


def _error(request: GenerateRequest, why: str) -> StepOutput:
    return StepOutput(token=None, finish_reason=FinishReason.ERROR, error=why, prompt_tokens=len(request.prompt_tokens))
