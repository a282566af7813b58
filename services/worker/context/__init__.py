"""What the model sees: the context of each model request, built in the documented order.

| room | job |
|---|---|
| `messages.py` | parts as Messages API messages (the rules on which calls go) |
| `builder.py` | each request of an attempt, in the documented order, with its breakpoints |
"""

from services.worker.context.messages import build_messages, render_messages

__all__ = ["build_messages", "render_messages"]
