"""The GPU bench's engine columns: the bench config with the measured model on another engine, as a TOML file
that the bench's broker reads."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from shmbroker.broker.common import config


def engine_config(cfg: config.Config, model: str, engine: str, package: str = "", max_batch: int = 0,
                  streams: int = 0, options: dict[str, Any] | None = None) -> config.Config:
    """``cfg`` with ``model`` on ``engine``: "torch" runs the config's ONNX file, "null" only reads its IO (the
    options then set ``null_compute_us``), "inductor" the package at
    ``package``; ``max_batch`` and ``streams`` (when not 0) and ``options`` (``models.MODEL`` keys) replace
    the model's. ConfigError names what is missing or wrong."""
    data = config.to_dict(cfg)
    source = str(data.pop("source", ""))
    section: dict[str, Any] = dict(data["models"][model])  # type: ignore[index]
    section["path"] = cfg.model_path(model)
    if engine == "inductor":
        if not package:
            raise config.ConfigError(f"the inductor column needs a package: --inductor PATH (shmbroker build "
                                     f"--engine inductor), or a config whose models.{model}.engine is 'inductor'")
        section["path"] = str(Path(package).resolve())
        section["fp16"] = False  # the package carries its precision (config refuses fp16 with it)
    elif engine in ("torch", "null") and section["engine"] == "inductor":
        raise config.ConfigError(f"the {engine} column needs models.{model} as an ONNX file: give a config on engine "
                                 "'torch' (bench/gpu.toml) and the package with --inductor")
    section["engine"] = engine
    if engine == "null":
        section["fp16"] = False  # no model computes: only the ONNX file's IO is read
    if max_batch:
        section["max_batch"] = max_batch
    if streams:
        section["streams"] = streams
    for key, value in (options or {}).items():
        where, _, name = key.rpartition(".")
        if where:  # another section's key: worker.gil_switch_us
            if where not in data or "." in where or not isinstance(data[where], dict):
                raise config.ConfigError(f"--set {key}: no section {where!r} (say worker.spin_us=0)")
            data[where] = {**data[where], name: value}  # type: ignore[dict-item]
        else:
            section[name] = value
    data["models"] = {model: section}
    return config.parse(data, source or "<bench>")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, each VALUE read as a TOML value (``true``, ``3``, ``"text"``) or else as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise config.ConfigError(f"--set {pair!r}: give KEY=VALUE, a key of the model's section (say "
                                     "serial_compute=true)")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw.strip()
    return out


def _value(v: Any) -> str:
    return json.dumps(v)  # TOML's strings, integers, floats, booleans and arrays of them read as JSON writes them


def to_toml(cfg: config.Config) -> str:
    """``cfg`` as a TOML document that ``config.load`` reads back equal (every model path absolute)."""
    data = config.to_dict(cfg)
    data.pop("source", None)
    lines: list[str] = []
    for name, section in data.items():
        if name == "models":
            continue
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in section.items()]  # type: ignore[attr-defined]
    for model in data["models"]:  # type: ignore[attr-defined]
        section = dict(data["models"][model])  # type: ignore[index]
        section["path"] = cfg.model_path(model)
        lines.append(f"[models.{model}]")
        lines += [f"{k} = {_value(v)}" for k, v in section.items()]
    return "\n".join(lines) + "\n"


def write(cfg: config.Config, path: Path) -> Path:
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path
