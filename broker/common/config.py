"""The TOML configuration: typed sections, validated once; an error names the key and what was expected."""

from __future__ import annotations

import grp
import os
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shmbroker.broker.common import batchrules, imaging
from shmbroker.broker.common.engines import choices_text, engine_table
from shmbroker.broker.common.protocol import INPUT_KINDS, MAX_SLOTS, InputKind

# package data (shmbroker.configs), so a wheel carries it as a checkout does
DEFAULT_CONFIG = Path(str(resources.files("shmbroker.configs").joinpath("default.toml"))).resolve()
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

Ms = Annotated[int, Meta(ge=1, le=3_600_000)]


class ConfigError(ValueError):
    """The configuration is not valid; the message names the key."""


class BrokerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    runtime_dir: str = ""  # SHMBROKER_RUNTIME_DIR, then this, then /run/shmbroker, then a per-user dir
    group: str = ""  # when set, segments and sockets are 0660 and owned by this group
    handshake_timeout_ms: Ms = 5000
    worker_start_timeout_ms: Ms = 120_000  # a starting worker's longest step (WORKER_PROGRESS), not its whole start
    restart_backoff_ms: Annotated[int, Meta(ge=0, le=60_000)] = 200
    session_check_ms: Ms = 1000
    worker_mode: Literal["process", "thread"] = "process"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class SessionsSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    default_slots: Annotated[int, Meta(ge=1, le=MAX_SLOTS)] = 16
    max_slots: Annotated[int, Meta(ge=1, le=MAX_SLOTS)] = 1024  # the SUBMIT size bound (protocol) rests on this
    # rows a slot holds when the client does not say; 0: as many as default_ring_mib allows
    default_max_items: Annotated[int, Meta(ge=0, le=4096)] = 0
    # with default_max_items = 0: a default session's ring (every byte of it page-locked by a GPU worker) is
    # at most this big, its slots holding as many rows of the largest model as fit, at least one, at most the
    # largest max_batch; clients split larger requests into parts. 0: every slot holds the largest max_batch
    default_ring_mib: Annotated[int, Meta(ge=0, le=1 << 20)] = 64
    max_session_mib: Annotated[int, Meta(ge=1, le=1 << 20)] = 4096
    # caps on what clients hold at once (sessions in set-up included), all users together and each uid: a
    # HELLO past one gets LIMIT naming the key. Ring memory is RAM: 0 means half the machine's memory, and
    # half of max_ring_mib per uid. systemd/shmbroker.service's LimitNOFILE is sized for max_sessions. The caps
    # in effect (broker.serving.sessions.Caps) give a uid at most half of each total.
    max_sessions: Annotated[int, Meta(ge=1, le=16384)] = 1024
    max_sessions_per_uid: Annotated[int, Meta(ge=1, le=16384)] = 256
    max_ring_mib: Annotated[int, Meta(ge=0, le=1 << 30)] = 0
    max_ring_mib_per_uid: Annotated[int, Meta(ge=0, le=1 << 30)] = 0


class WorkerSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    devices: list[int | str] = msgspec.field(default_factory=lambda: ["cpu"])
    # after traffic, a process worker polls its data socket without sleeping for this long (0: never)
    spin_us: Annotated[int, Meta(ge=0, le=100_000)] = 1000
    # a worker process's sys.setswitchinterval: how long a thread that wants the GIL waits before the holder must
    # let go (0: Python's own, 5000)
    gil_switch_us: Annotated[int, Meta(ge=0, le=1_000_000)] = 0


class MonitoringSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    http_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # /health and /metrics; 0: no HTTP server
    http_host: str = "127.0.0.1"
    probe_interval_ms: Annotated[int, Meta(ge=0, le=3_600_000)] = 5000  # dummy inference per model; 0: none
    probe_timeout_ms: Ms = 2000
    ready_max_age_ms: Ms = 15_000  # /health/ready wants a passed probe at most this old


class ModelSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str
    engine: str = "onnxruntime"  # a name of the engine table (broker/common/engines.py)
    max_batch: Annotated[int, Meta(ge=1, le=4096)] = 8
    max_queue_delay_us: Annotated[int, Meta(ge=0, le=10_000_000)] = 1000
    # a name of the batching-rule table (broker/common/batchrules.py): "idle", a batch leaves at once, without
    # max_queue_delay_us, while an engine instance (CPU) or the GPU is idle; "triton", every batch waits by
    # Triton's rule (bench/RESULTS.md#idle-dispatch)
    batching: str = batchrules.DEFAULT
    preferred_batch_sizes: list[Annotated[int, Meta(ge=1, le=4096)]] = msgspec.field(default_factory=list)
    max_queue_size: Annotated[int, Meta(ge=1, le=1_000_000)] = 256
    # a batch takes each client session's queued requests together (sessions in the order of their oldest
    # request) instead of strictly in arrival order: a client process then gets many answers in one message, one
    # wake-up of its receiving thread; a request may wait up to one batch more for each other session with older
    # requests queued (bench/RESULTS.md#batches-by-session-on-an-h100)
    batch_by_session: bool = False
    timeout_ms: Ms = 500
    intra_op_threads: Annotated[int, Meta(ge=0, le=256)] = 0
    # host engines: batches run at once, each on its own runner thread; the GPU pipeline has streams instead
    instances: Annotated[int, Meta(ge=1, le=64)] = 1
    warmup: bool = True
    # GPU engines (torch, inductor, tensorrt) only; a CPU worker ignores them; fp16: torch only (a package or
    # plan carries its own precision)
    streams: Annotated[int, Meta(ge=1, le=16)] = 4  # stream slots: batches in flight on the device at once
    # a batch's compute waits for the previous batch's (copies still overlap): each batch computes alone, at its
    # one-stream time; computes that share the device run slower per row
    # (bench/RESULTS.md#one-batch-computes-at-a-time)
    serial_compute: bool = True
    # while the device computes other batches, a batch that is not full keeps growing until the device is about
    # to need it, not just for max_queue_delay_us (bench/RESULTS.md#filling-batches-while-the-device-is-busy)
    fill_while_busy: bool = True
    # while another batch runs, a batch takes the largest batch size the engine prepared (a CUDA graph's) that its
    # rows reach and leaves the rest for the next, instead of padding to the next size
    trim_to_sizes: bool = True
    # with fill_while_busy: a batch opens by the delay alone and its rows are copied to the device as they come, so
    # it can fill until the device needs it, less one chunk's copies instead of a whole batch's
    early_copies: bool = False
    fp16: bool = False
    cuda_graphs: bool = True
    # engine "null" only (benchmarks of the host path): each batch's device time, whatever its rows
    null_compute_us: Annotated[int, Meta(ge=0, le=10_000_000)] = 0
    # what clients send: "tensor" (the engine's own input), "image" (encoded JPEG or PNG, one a row) or "frames"
    # (uint8 HWC of frame_shape); the worker makes the engine's input of them by the named preprocess preset
    input: str = InputKind.TENSOR
    preprocess: str = ""  # a name of broker/common/imaging.py's PRESETS; required with input "image" or "frames"
    # input "image": a row of more bytes is refused, and a ring slot holds rows of this size (default_ring_mib)
    max_image_bytes: Annotated[int, Meta(ge=64, le=1 << 30)] = 4 << 20
    # input "image": an image of more pixels (width x height, read from its header) is refused before decoding
    max_image_pixels: Annotated[int, Meta(ge=1, le=1 << 40)] = 40_000_000
    # input "image" on a GPU worker: the JPEG decoder, a name of gpu_worker/devicedecoders.py's DECODERS; "" takes
    # the first of them that works on the device
    gpu_decoder: str = ""
    frame_shape: list[Annotated[int, Meta(ge=1, le=65536)]] = msgspec.field(default_factory=list)  # [H, W]


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    broker: BrokerSection = msgspec.field(default_factory=BrokerSection)
    sessions: SessionsSection = msgspec.field(default_factory=SessionsSection)
    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    monitoring: MonitoringSection = msgspec.field(default_factory=MonitoringSection)
    models: dict[str, ModelSection] = msgspec.field(default_factory=dict)
    source: str = ""  # the file it came from; model paths are relative to its folder

    def model_path(self, name: str) -> str:
        """A model's path, resolved against the config file's folder (``pkg:`` and ``builtin:`` kept)."""
        raw = self.models[name].path
        if raw.startswith(("pkg:", "builtin:")) or os.path.isabs(raw):
            return raw
        base = Path(self.source).parent if self.source else Path.cwd()
        return str((base / raw).resolve())

    def group_id(self) -> int | None:
        if not self.broker.group:
            return None
        return grp.getgrnam(self.broker.group).gr_gid

    @property
    def file_mode(self) -> int:
        return 0o660 if self.broker.group else 0o600


def _pretty(err: str, prefix: str = "") -> str:
    # msgspec says "... - at `$.models.nsfw.max_batch`"; users write keys as dotted TOML paths
    m = re.search(r"^(.*) - at `\$\.?(.*)`$", err)
    what, where = m.groups() if m else (err, "")
    key = ".".join(p for p in (prefix, where) if p)
    return f"key '{key}': {what}" if key else what


def parse(data: dict[str, object], source: str = "<dict>") -> Config:
    """Validate a parsed TOML document; raise ConfigError naming the key and the expectation."""
    _check_replaced(data, source)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        # msgspec writes a dict value's path as `models[...]`; validate each model alone to name it
        models = data.get("models")
        for name, section in models.items() if isinstance(models, dict) else ():
            try:
                msgspec.convert(section, ModelSection)
            except msgspec.ValidationError as model_exc:
                raise ConfigError(f"{source}: {_pretty(str(model_exc), f'models.{name}')}") from None
        raise ConfigError(f"{source}: {_pretty(str(exc))}") from None
    cfg.source = source if source != "<dict>" else ""
    _check(cfg, source)
    return cfg


def _check_replaced(data: dict[str, object], source: str) -> None:
    """A key that a newer one replaced gets an error that names the new key and the value to write."""
    models = data.get("models")
    for name, section in models.items() if isinstance(models, dict) else ():
        if isinstance(section, dict) and "idle_dispatch" in section:
            old = section["idle_dispatch"]
            value = {True: '"idle"', False: '"triton"'}.get(old, '"idle" (for true) or "triton" (for false)')
            raise ConfigError(f"{source}: key 'models.{name}.idle_dispatch': replaced by models.{name}.batching; "
                              f"write batching = {value}")


def _check(cfg: Config, source: str) -> None:
    if not cfg.models:
        raise ConfigError(f"{source}: key 'models': expected at least one [models.NAME] table")
    for name, m in cfg.models.items():
        if not _NAME.match(name):
            raise ConfigError(f"{source}: key 'models.{name}': a model name is 1-64 of [A-Za-z0-9_.-]")
        if m.engine not in engine_table():
            raise ConfigError(f"{source}: key 'models.{name}.engine': unknown engine {m.engine!r}: expected one of "
                              f"{choices_text()}")
        if m.batching not in batchrules.rule_table():
            raise ConfigError(f"{source}: key 'models.{name}.batching': unknown batching rule {m.batching!r}: "
                              f"expected one of {batchrules.choices_text()}")
        if m.engine == "inductor" and m.fp16:
            raise ConfigError(f"{source}: key 'models.{name}.fp16': an inductor package carries its own precision; "
                              "drop the key and build the package with shmbroker build --precision fp16")
        if m.null_compute_us and m.engine != "null":
            raise ConfigError(f"{source}: key 'models.{name}.null_compute_us': only engine 'null' (a benchmark of the "
                              f"host path) has a fixed compute time; engine is {m.engine!r}: drop the key")
        if m.early_copies and not m.fill_while_busy:
            raise ConfigError(f"{source}: key 'models.{name}.early_copies': a batch fills on the device only until the "
                              "device needs it, so it needs fill_while_busy = true (or drop early_copies)")
        _check_input(name, m, source)
        too_big = [b for b in m.preferred_batch_sizes if b > m.max_batch]
        if too_big:
            raise ConfigError(
                f"{source}: key 'models.{name}.preferred_batch_sizes': {too_big} exceed max_batch {m.max_batch}"
            )
    if not cfg.worker.devices:
        raise ConfigError(f"{source}: key 'worker.devices': expected at least one device")
    for i, dev in enumerate(cfg.worker.devices):
        if not (dev == "cpu" or (isinstance(dev, int) and not isinstance(dev, bool) and dev >= 0)):
            raise ConfigError(f"{source}: key 'worker.devices[{i}]': expected \"cpu\" or a GPU index >= 0, got {dev!r}")
    mon = cfg.monitoring
    if mon.probe_interval_ms and mon.ready_max_age_ms < mon.probe_interval_ms + mon.probe_timeout_ms:
        raise ConfigError(f"{source}: key 'monitoring.ready_max_age_ms': must be at least probe_interval_ms + "
                          f"probe_timeout_ms ({mon.probe_interval_ms + mon.probe_timeout_ms}), or readiness flaps")
    if cfg.sessions.max_sessions_per_uid > cfg.sessions.max_sessions:
        raise ConfigError(f"{source}: key 'sessions.max_sessions_per_uid': must not exceed sessions.max_sessions")
    if cfg.sessions.default_slots > cfg.sessions.max_slots:
        raise ConfigError(f"{source}: key 'sessions.default_slots': must not exceed sessions.max_slots")
    if cfg.sessions.default_ring_mib > cfg.sessions.max_session_mib:
        raise ConfigError(f"{source}: key 'sessions.default_ring_mib': must not exceed sessions.max_session_mib "
                          f"({cfg.sessions.max_session_mib})")
    if cfg.broker.group:
        try:
            grp.getgrnam(cfg.broker.group)
        except KeyError:
            raise ConfigError(f"{source}: key 'broker.group': no group named {cfg.broker.group!r}") from None


def _check_input(name: str, m: ModelSection, source: str) -> None:
    """The input kind and its keys agree: a preset for images and frames, a frame shape for frames only."""
    key = f"{source}: key 'models.{name}"
    if m.input not in INPUT_KINDS:
        raise ConfigError(f"{key}.input': expected one of {', '.join(map(repr, INPUT_KINDS))}, got {m.input!r}")
    if m.input == InputKind.TENSOR:
        if m.preprocess or m.frame_shape:
            what = "preprocess" if m.preprocess else "frame_shape"
            raise ConfigError(f"{key}.{what}': only a model with input = \"image\" or \"frames\" is preprocessed; "
                              "set input or drop the key")
        return
    if m.preprocess not in imaging.PRESETS:
        raise ConfigError(f"{key}.preprocess': input {m.input!r} needs a preset: expected one of "
                          f"{imaging.presets_text()}, got {m.preprocess!r}")
    if (m.input == InputKind.FRAMES) != bool(m.frame_shape) or (m.frame_shape and len(m.frame_shape) != 2):
        raise ConfigError(f"{key}.frame_shape': input \"frames\" needs frame_shape = [HEIGHT, WIDTH], and only it")


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate a TOML file (the default config when ``path`` is None)."""
    p = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # a file that is not UTF-8 is not TOML
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse(data, str(p.resolve()))


def to_dict(cfg: Config) -> dict[str, object]:
    out: dict[str, object] = msgspec.to_builtins(cfg)
    return out
