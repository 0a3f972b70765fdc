"""Anthropic's Messages API (`/v1/messages`): request.py reads it, writer.py writes it, messages.py routes it."""
