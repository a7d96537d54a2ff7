"""`memfit serve`: an OpenAI-compatible HTTP server over the inference engine (FastAPI and
uvicorn; `pip install memfit[serve]`)."""

from memfit.inference.server.app import build_app
from memfit.inference.server.async_engine import AsyncEngine, QueueFull, Update
from memfit.inference.server.background import BackgroundServer
from memfit.inference.server.core import EngineState

__all__ = ["AsyncEngine", "BackgroundServer", "EngineState", "QueueFull", "Update", "build_app"]
