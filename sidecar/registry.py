"""The served models: each name maps to its spec, tokenizer, engines (one per device) and scheduler."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core_engine.config import ModelSpec
from core_engine.settings import SidecarConfig
from sidecar.errors import not_found
from sidecar.scheduler import Scheduler, SchedulerConfig
from sidecar.tokenize import TextTokenizer, TokenizerProcesses, default_processes


@dataclass
class ServedModel:
    """One model as the gateway sees it."""

    spec: ModelSpec
    tokenizer: TextTokenizer
    scheduler: Scheduler
    engines: list = field(default_factory=list)  # core_engine Engines, one per device
    pairs: object | None = None  # a reranker's PairTokenizer (sidecar.tokenize.pairs), made on first use


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a directory, and optionally the name to serve it under."""

    path: Path | None  # None: the bundled default model
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "ModelSource":
        """`DIR` or `NAME=DIR` (as `fern serve --model` takes it); "" or "default" is the bundled model."""
        name, sep, path = text.partition("=")
        if not sep:
            name, path = "", text
        if path in ("", "default"):
            return cls(None, name or None)
        return cls(Path(path).expanduser(), name or None)


def engine_devices(device: str) -> list[str]:
    """The devices to put one engine each on.

    "auto": every visible CUDA GPU, else the CPU. "cuda": every visible GPU. "cpu",
    "cuda:N", or a comma-separated list ("cuda:0,cuda:2") as given.
    """
    import torch

    if "," in device:
        return [d.strip() for d in device.split(",") if d.strip()]
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if device == "cuda":
            raise ValueError("device 'cuda': CUDA is not available on this machine (try --device cpu)")
        return ["cpu"]
    return [device]


class Registry:
    """Model name → ServedModel; "" names the default model (the first one loaded)."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("a registry needs at least one model")
        self._models: dict[str, ServedModel] = {}
        for served in models:
            if served.spec.name in self._models:
                raise ValueError(f"model name {served.spec.name!r} is given twice; "
                                 "serve one under another name with --model NAME=DIR")
            self._models[served.spec.name] = served
        self.default_model = models[0].spec.name

    @classmethod
    def load(cls, sources: Sequence[ModelSource], *, device: str = "auto", dtype: str = "auto",
             attention: str = "auto", cuda_graphs: bool = True,
             scheduler_config: SchedulerConfig | Callable[[str], SchedulerConfig] | None = None,
             tokenizer_workers: int | None = None, tokenizer_processes: int | None = None,
             prewarm: str = "", settings: SidecarConfig | None = None,
             compile_in_background: bool = False) -> "Registry":
        """Build engines (one per device) and a scheduler for every model source.

        `prewarm`: shapes each engine captures before serving ("queries", "128x1,512x32": see
        core_engine.graphs.prewarm_shapes); "queries" follows each model's own token limit.
        `compile_in_background`: engines that compile serve at once, uncompiled, and switch to the
        compiled model when it is ready (EngineConfig.compile_in_background).

        `scheduler_config` is a SchedulerConfig, or a function of the device type ("cuda",
        "cpu") returning one, or None for SchedulerConfig.for_device's defaults. `settings`
        sizes the tokenizers' memo and Rust pool and sets the default scheduler's loop launch
        (default: SidecarConfig()'s).
        """
        from core_engine.engine import Engine  # torch: only when models are loaded
        from core_engine.loader import default_model_dir

        settings = settings or SidecarConfig()
        devices = engine_devices(device)
        # One set of tokenizer worker processes serves every model (see TokenizerProcesses).
        processes = default_processes() if tokenizer_processes is None else tokenizer_processes
        shared = TokenizerProcesses(processes) if processes > 0 else None
        models = []
        for source in sources or [ModelSource(None)]:
            path = source.path if source.path is not None else default_model_dir()
            engines = [Engine(path, name=source.name, device=d, dtype=dtype, attention=attention,
                              cuda_graphs=cuda_graphs, prewarm=prewarm, compile_in_background=compile_in_background)
                       for d in devices]
            spec = engines[0].spec
            config = scheduler_config(engines[0].device.type) if callable(scheduler_config) \
                else scheduler_config or SchedulerConfig.for_device(
                    engines[0].device.type, launch_on_arrival=settings.launch_on_arrival,
                    online_poll_s=settings.online_poll_s)
            tokenizer = TextTokenizer.for_spec(spec, tokenizer_workers, shared if shared is not None else 0,
                                               memo_chunks=settings.token_memo_chunks,
                                               rust_threads=settings.tokenizer_rust_threads)
            models.append(ServedModel(spec, tokenizer, Scheduler(engines, config), engines))
        if shared is not None:
            shared.start()
        return cls(models)

    def get(self, name: str = "") -> ServedModel:
        """The model called `name` ("" = default); NOT_FOUND names what is served."""
        served = self._models.get(name or self.default_model)
        if served is None:
            raise not_found(f"model: {name!r} is not served here (served: {', '.join(self._models)})")
        return served

    def specs(self) -> list[ModelSpec]:
        """ModelSpecs of every served model, the default first."""
        default = self._models[self.default_model]
        return [default.spec] + [m.spec for m in self._models.values() if m is not default]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    async def start(self) -> None:
        for served in self._models.values():
            await served.scheduler.start()

    async def drain(self) -> None:
        """Finish what every scheduler holds, then stop their loops."""
        for served in self._models.values():
            await served.scheduler.drain()

    def close(self) -> None:
        for served in self._models.values():
            served.tokenizer.close()
