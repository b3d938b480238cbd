"""``dspark convert`` / ``dspark-convert``: a Hugging Face checkpoint -> an optimized model directory.

Module level stays light (typer only); torch and the plugins load when a
conversion starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def convert(
    model_path: Annotated[Path, typer.Option("--model-path", help="Source checkpoint directory (Hugging Face format) or .gguf file.")],
    output_path: Annotated[Path, typer.Option("--output-path", help="Directory to write (must not exist).")],
    quantization: Annotated[str, typer.Option(
        "--quantization", help="none | int8 | int4 | int8_mixed | int4_mixed | auto_mixed_precision | "
        "int8_activation_fp16_weight (= int8_mixed).")] = "int8_mixed",
    speculative_draft_model_spec: Annotated[str, typer.Option(
        "--speculative-draft-model-spec", help="auto | none | a draft checkpoint directory.")] = "auto",
    calibration_data_path: Annotated[Path | None, typer.Option(
        "--calibration-data-path", help="JSONL with one {\"text\": ...} per line (default: stdlib files "
        "the embedded model did not hold out).")] = None,
    group_size: Annotated[int | None, typer.Option(help="int4 group size (default 128).")] = None,
    max_drop: Annotated[float | None, typer.Option(
        help="Allowed relative calibration-perplexity increase (default 0.01 int8, 0.04 int4).")] = None,
    sensitive_layers: Annotated[list[str] | None, typer.Option(
        "--sensitive-layer", help="Keep this layer float (name, substring or pattern); repeatable.")] = None,
    devices: Annotated[str, typer.Option(help="auto | a device-profile YAML, for the device plan.")] = "auto",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON instead of a table.")] = False,
) -> None:
    """Quantize (mixed precision, calibrated) and package a checkpoint for `dspark serve` and `dspark.LLM`."""
    from pydantic import ValidationError

    from dspark.llm.runner.loader import CheckpointError
    from dspark.llm.config import QuantizationConfig
    from dspark.llm.quantization.convert import ConvertError
    from dspark.llm.quantization.convert import convert as run
    from dspark.llm.quantization.data import CalibrationDataError

    fields: dict[str, object] = {"method": quantization}
    for key, value in (("group_size", group_size), ("max_drop", max_drop), ("sensitive_layers", sensitive_layers)):
        if value is not None:
            fields[key] = value
    try:
        qcfg = QuantizationConfig.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "quantization"
        typer.echo(f"error: --{where.replace('_', '-').replace('method', 'quantization')}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True, disable=as_json) as bar:
        task = bar.add_task("calibrating", total=None)

        def progress(what: str, i: int, n: int) -> None:
            bar.update(task, description=f"calibrating: {what}", completed=i, total=n)

        try:
            plan = run(model_path, output_path, quantization=qcfg, draft_spec=speculative_draft_model_spec,
                       calibration_data_path=calibration_data_path, devices=devices, overwrite=overwrite,
                       progress=progress)
        except (ConvertError, CheckpointError, CalibrationDataError, FileNotFoundError, ValueError) as e:
            bar.stop()
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps({"output_path": str(output_path), "plan": json.loads(plan.to_json())}, indent=2))
    else:
        typer.echo(plan.table())
        typer.echo(f"wrote {output_path}")


def main() -> None:
    from dspark.host import log

    log.configure()
    app = typer.Typer(add_completion=False)
    app.command()(convert)
    app()


if __name__ == "__main__":
    main()
