"""What the tests of the engine on a plugin's decoder share: the embedded model, five prompts, and running them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams

MODEL = Path(__file__).resolve().parents[3] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
PROMPTS = ["def main():\n    args = parse()\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n    print(i)\nfor j in range(", "# a long comment " * 6]


def run_prompts(engine: LLMEngine, params: list[SamplingParams], prios: list[int] | None = None) -> dict[str, Any]:
    """Every prompt of PROMPTS with its params (and priority), run to the end; every KV page comes back."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), p, sp, priority=(prios or [0] * len(PROMPTS))[i])
    out: dict[str, Any] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
    assert engine.cache.all_free()
    return out


def float_engine(decoder: str, model: Path | str = MODEL, **kw: Any) -> LLMEngine:
    return LLMEngine.from_model(model, dtype="float32", decoder=decoder, **kw)


def greedy(n: int = 24) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _ in PROMPTS]
