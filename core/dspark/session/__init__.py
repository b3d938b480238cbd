"""The one-call API for any model: :class:`Session` (ONNX Runtime's ``run`` signature over dspark's placement)."""

from dspark.session.metadata import NodeArg
from dspark.session.session import Session, SessionError

__all__ = ["NodeArg", "Session", "SessionError"]
