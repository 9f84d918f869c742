"""GPU, model and price catalogs: shipped TOML files extended by the user's own."""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "catalogs"
PRECISIONS = ("bf16", "fp16", "fp8", "int8", "int4")
KV_PRECISIONS = ("bf16", "fp16", "fp8", "int8")


class CatalogError(ValueError):
    """A catalog or config file a user can fix: the message names the file and the field."""


class UnknownNameError(KeyError):
    """A model or GPU name not in the catalog; the message lists the closest names."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Gpu:
    """One accelerator: memory, bandwidth, dense FLOP/s per precision, link, power and price."""

    name: str
    memory_gb: float
    bandwidth_gbs: float
    tflops: dict[str, float]
    interconnect: str
    link_gbs: float
    link_latency_us: float
    power_w: float
    source: str
    date: str
    on_demand: float = 0.0
    spot: float | None = None
    price_source: str = ""
    price_date: str = ""
    aliases: tuple[str, ...] = ()
    # The engine's own per-step host overhead measured on this device (engine/device_profile.py
    # writes it for the machine the app runs on); the step-time model never goes below it.
    step_overhead_ms: float = 0.0
    # Per engine measured here ("servescope", "vllm"): the bfloat16 matmul rate it reaches
    # (`tflops_bf16`, over the planner's FLOPs fraction as `tflops`), its fixed cost per step
    # (`overhead_ms`) and its cost per sequence in a step (`per_seq_ms`), fitted to its own
    # steps; a Deployment naming that engine is timed with them.
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    # The scale-out network between nodes, per GPU (its own NIC), GB/s per direction: what
    # context parallelism's ranks on other nodes exchange keys and values over. 0: the catalog
    # knows of no multi-node form of this GPU, so no plan spans nodes by context parallelism.
    network_gbs: float = 0.0
    # One ring step between nodes: NCCL's hwLat for the network, ring algorithm, Simple
    # protocol (src/graph/tuning.cc), the protocol NCCL picks for the large messages CP sends.
    network_latency_us: float = 9.6

    def __post_init__(self) -> None:
        _check_engines(self.engines)
        if self.network_gbs < 0 or self.network_latency_us < 0:
            raise ValueError("network_gbs and network_latency_us must be non-negative")
        for name in ("memory_gb", "bandwidth_gbs", "link_gbs"):
            _positive(getattr(self, name), name)
        if self.power_w != 0:  # 0: not known (a CPU measured here)
            _positive(self.power_w, "power_w")
        if isinstance(self.step_overhead_ms, bool) or not isinstance(
                self.step_overhead_ms, int | float) or self.step_overhead_ms < 0:
            raise ValueError(f"step_overhead_ms must be a non-negative number, got "
                             f"{self.step_overhead_ms!r}")
        if "bf16" not in self.tflops:
            raise ValueError("tflops needs a bf16 figure")
        for key, value in self.tflops.items():
            _positive(value, f"tflops.{key}")
        if self.spot is not None:
            _positive(self.spot, "spot")

    def compute_tflops(self, precision: str) -> float:
        """Peak dense FLOP/s for math at `precision`; int4 and missing fp8 run as bf16 math."""
        key = "bf16" if precision in ("fp16", "int4") else precision
        return self.tflops.get(key, self.tflops["bf16"])

    @property
    def nvlink(self) -> bool:
        return self.interconnect.lower().startswith(("nvlink", "infinity"))


ENGINE_STEP_FIELDS = ("tflops_bf16", "overhead_ms", "per_seq_ms")


def engine_key(label: str) -> str:
    """The Gpu.engines key of an engine as runs store it ("vLLM 0.32.0" -> "vllm")."""
    words = label.strip().lower().split()
    return words[0] if words else ""


def _check_engines(engines: Any) -> None:
    """Every engine table has exactly ENGINE_STEP_FIELDS, as numbers: positive for the rate,
    non-negative for the costs."""
    if not isinstance(engines, dict):
        raise ValueError(f"engines must be a table of engine tables, got {engines!r}")
    for name, table in engines.items():
        if not isinstance(table, dict) or set(table) != set(ENGINE_STEP_FIELDS):
            raise ValueError(f"engines.{name} must have exactly the fields "
                             f"{', '.join(ENGINE_STEP_FIELDS)}")
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (
                    key == "tflops_bf16" and value == 0):
                raise ValueError(f"engines.{name}.{key} must be a "
                                 f"{'positive' if key == 'tflops_bf16' else 'non-negative'} "
                                 f"number, got {value!r}")


@dataclass(frozen=True)
class Model:
    """One transformer's architecture, enough for memory and time estimates (dense, MoE, MLA)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params_b: float
    source: str
    date: str
    hf_id: str = ""
    active_params_b: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    max_context: int = 4096
    aliases: tuple[str, ...] = ()
    tied_embeddings: bool = False  # the LM head reuses the embedding matrix (small models)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "params_b"):
            _positive(getattr(self, name), name)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError("experts_per_token must be between 1 and experts")
        if self.active_params_b == 0.0:
            object.__setattr__(self, "active_params_b", self.params_b)
        if self.active_params_b > self.params_b:
            raise ValueError("active_params_b cannot exceed params_b")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3.0 * self.hidden * self.moe_intermediate

    @property
    def embedding_params(self) -> float:
        """The embedding and LM-head matrices inside params_b (one when they are tied)."""
        return (1.0 if self.tied_embeddings else 2.0) * self.vocab * self.hidden


@dataclass(frozen=True)
class Catalog:
    """The GPUs and models the planner may use, after the user's files are merged in."""

    gpus: dict[str, Gpu]
    models: dict[str, Model]
    files: tuple[str, ...] = field(default=())

    def gpu(self, name: str) -> Gpu:
        return _lookup(self.gpus, name, "GPU")

    def model(self, name: str) -> Model:
        return _lookup(self.models, name, "model")

    def with_model(self, model: Model) -> Catalog:
        return Catalog(self.gpus, {**self.models, model.name: model}, self.files)


def _positive(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _lookup(table: dict, name: str, kind: str) -> Any:
    key = name.strip().lower()
    for entry in table.values():
        if key == entry.name.lower() or key in (a.lower() for a in entry.aliases):
            return entry
    raise UnknownNameError(f"unknown {kind} {name!r}; " + suggest(name, table))


def suggest(name: str, table: dict) -> str:
    """'did you mean ...' naming the closest catalog names (difflib), or all of them."""
    names = {n.lower(): n for n in table}
    for entry in table.values():
        names.update({a.lower(): entry.name for a in entry.aliases})
    close = difflib.get_close_matches(name.lower(), list(names), n=5, cutoff=0.4)
    found = list(dict.fromkeys(names[c] for c in close))
    if found:
        return "did you mean " + " or ".join(repr(n) for n in found[:3]) + "?"
    return "known names: " + ", ".join(sorted(table))


def config_dir() -> Path:
    """The user's config folder: $SERVESCOPE_CONFIG_DIR, else the platform's config dir."""
    override = os.environ.get("SERVESCOPE_CONFIG_DIR")
    if override:
        return Path(override)
    from platformdirs import user_config_dir

    return Path(user_config_dir("servescope"))


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a syntax error becomes a CatalogError naming the file and line."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML ({exc})") from exc
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read it ({exc.strerror})") from exc


def _sections(path: Path, table: str) -> dict[str, dict[str, Any]]:
    data = read_toml(path).get(table, {})
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: [{table}] must be a table of named entries")
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise CatalogError(f"{path}: {table}.{name!r} must be a table of fields")
    return data


# The machine the app runs on, measured by engine/device_profile.py (a file of its own, so the
# user's gpus.toml is never rewritten); read after gpus.toml.
MACHINE_FILE = "machine.toml"


def _merged(table: str, filename: str, user_dir: Path | None,
            extra: tuple[str, ...] = ()) -> tuple[dict, dict, list[str]]:
    """Entries of the shipped file overlaid field-by-field with the user's file(s)."""
    shipped = ASSETS / filename
    entries = {k: dict(v) for k, v in _sections(shipped, table).items()}
    origin = {k: shipped for k in entries}
    used = [str(shipped)]
    for name in (filename, *extra):
        user = (user_dir or config_dir()) / "catalogs" / name
        if user.is_file():
            used.append(str(user))
            for entry, values in _sections(user, table).items():
                entries.setdefault(entry, {}).update(values)
                origin[entry] = user
    return entries, origin, used


def build(cls: type, name: str, values: dict[str, Any], path: Path, table: str) -> Any:
    """Construct `cls` from a TOML entry; every problem names the file, entry and field."""
    known = {f.name for f in fields(cls)} - {"name"}
    where = f"{path}: {table}.{name!r}"
    extra = sorted(set(values) - known)
    if extra:
        raise CatalogError(f"{where} has unknown field {extra[0]!r}")
    missing = sorted(f.name for f in fields(cls) if f.name in known and f.name not in values
                     and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise CatalogError(f"{where} is missing field {missing[0]!r}")
    args = {k: tuple(v) if k == "aliases" else v for k, v in values.items()}
    try:
        return cls(name=name, **args)
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"{where}: {exc}") from exc


def _attach_price(gpu_values: dict, price: dict | None, where: str) -> None:
    if price is None:
        return
    for key in ("on_demand", "source", "date"):
        if key not in price:
            raise CatalogError(f"{where} is missing field {key!r}")
    gpu_values.update(on_demand=price["on_demand"], spot=price.get("spot"),
                      price_source=price["source"], price_date=str(price["date"]))


def gpu_entries_as_names(entries: dict) -> dict:
    """Raw entries shaped for `suggest` (objects with a name and aliases)."""
    return {n: _Named(n, tuple(v.get("aliases", ()))) for n, v in entries.items()}


@dataclass(frozen=True)
class _Named:
    name: str
    aliases: tuple[str, ...]


def load_catalog(user_dir: Path | None = None) -> Catalog:
    """The shipped catalogs merged with `<config dir>/catalogs/{gpus,models,prices}.toml`."""
    gpu_entries, gpu_origin, files = _merged("gpu", "gpus.toml", user_dir, (MACHINE_FILE,))
    price_entries, price_origin, more = _merged("price", "prices.toml", user_dir)
    model_entries, model_origin, most = _merged("model", "models.toml", user_dir)
    for name in price_entries:
        if name not in gpu_entries:
            raise CatalogError(f"{price_origin[name]}: price.{name!r} names no GPU in the catalog; "
                               + suggest(name, gpu_entries_as_names(gpu_entries)))
    gpus = {}
    for name, values in gpu_entries.items():
        values = {k: str(v) if k == "date" else v for k, v in values.items()}
        where = f"{price_origin.get(name, gpu_origin[name])}: price.{name!r}"
        _attach_price(values, price_entries.get(name), where)
        gpus[name] = build(Gpu, name, values, gpu_origin[name], "gpu")
    models = {}
    for name, values in model_entries.items():
        values = {k: str(v) if k == "date" else v for k, v in values.items()}
        models[name] = build(Model, name, values, model_origin[name], "model")
    return Catalog(gpus, models, tuple(files + more[1:] + most[1:]))
