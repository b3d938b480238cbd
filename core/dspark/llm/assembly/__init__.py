"""What an LLM engine is assembled from, and the build that makes it (:mod:`.parts`)."""

from dspark.llm.assembly.parts import Devices, EngineParts, build_parts

__all__ = ["Devices", "EngineParts", "build_parts"]
