"""Encoder graph configuration and ``--hf-overrides`` parsing; it hands on the three errors
every user meets (``OmnitraceError``, ``ConfigError``, ``EncoderGraphFailedError``)."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from omnitrace._display import safe
from omnitrace._validate import (
    INT64_MAX,
    OversizedInt,
    check_bool,
    check_int,
    check_name,
    describe,
)
from omnitrace.errors import ConfigError, EncoderGraphFailedError, OmnitraceError

__all__ = [
    "AUDIO_ATTENTION_ROUTES",
    "DEFAULT_MAX_GRAPHS",
    "DEFAULT_POOL_BUDGET_BYTES",
    "HF_OVERRIDE_KEYS",
    "INT64_MAX",
    "MAX_GRAPHS_CAP",
    "ConfigError",
    "EncoderGraphConfig",
    "EncoderGraphFailedError",
    "OmnitraceError",
    "misspelt_key",
    "needed_free_bytes",
    "parse_hf_overrides",
    "spelt_like_a_key",
]

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: Graphs an encoder may keep when neither ``max_graphs`` nor a pool budget is set: a
#: ceiling, since the default pool budget decides how many shapes fit.
DEFAULT_MAX_GRAPHS = 32
#: The pool budget of each encoder when neither ``max_graphs`` nor a budget is set.
DEFAULT_POOL_BUDGET_BYTES = 2 * GiB
#: Most graphs an encoder may keep. Each holds static buffers and pool memory, and the
#: admission history keeps four keys per graph; no deployment needs more.
MAX_GRAPHS_CAP = 1024


def needed_free_bytes(need: int) -> int:
    """Device-free memory a capture waits for, under a pool budget, when its key's eager
    calls took ``need`` bytes at their peak: the need and an eighth more.

    Args:
        need: what the key's eager calls allocated at their peak.
    """
    return need + need // 8


_PREFIX = "encoder_cuda_graph"

#: The ``--hf-overrides`` keys, mapped to the config field each one sets.
HF_OVERRIDE_KEYS: Mapping[str, str] = {
    "encoder_cuda_graph": "enabled",
    "encoder_cuda_graph_max_graphs": "max_graphs",
    "encoder_cuda_graph_min_capture_calls": "min_capture_calls",
    "encoder_cuda_graph_min_free_bytes": "min_free_bytes",
    "encoder_cuda_graph_pool_budget_bytes": "pool_budget_bytes",
    "encoder_cuda_graph_share_pools": "share_pools",
    "encoder_cuda_graph_expandable_pools": "expandable_pools",
    "encoder_cuda_graph_compile": "compile",
    "encoder_cuda_graph_background_capture": "background_capture",
    "encoder_cuda_graph_device_timing": "device_timing",
    "encoder_cuda_graph_skip_profiling": "skip_profiling",
    "encoder_cuda_graph_audio_attention": "audio_attention",
    "encoder_cuda_graph_prepare_from": "prepare_from",
    "encoder_cuda_graph_split_items": "split_items",
}
_FIELD_TO_KEY = {v: k for k, v in HF_OVERRIDE_KEYS.items()}

#: Values of ``encoder_cuda_graph_audio_attention``, the default first.
AUDIO_ATTENTION_ROUTES = ("native", "masked")


#: JSON integers longer than this are not converted: no valid value comes close, and
#: Python refuses to convert past about 4,300 digits.
_MAX_JSON_DIGITS = 40


def _parse_json_int(text: str) -> int | OversizedInt:
    return OversizedInt(text) if len(text) > _MAX_JSON_DIGITS else int(text)


class _Unset(int):
    """The default of ``max_graphs`` and ``pool_budget_bytes``: not set by the user."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"


_UNSET = _Unset(-1)


@dataclass(frozen=True, slots=True)
class EncoderGraphConfig:
    """Admission and memory settings shared by the encoder graph adapters.

    Args:
        enabled: capture and replay graphs at all (``--enforce-eager`` forces false; every
            call is then an ``ineligible`` miss, detail ``disabled``).
        max_graphs: graphs retained per encoder, at most 1024; 0 captures nothing (a cache
            of zero graphs is full: every eligible call is a ``capacity`` miss). Not set
            (default): at most ``DEFAULT_MAX_GRAPHS`` (32), and the pool budget decides
            how many shapes fit (see ``pool_budget_bytes``).
        min_capture_calls: calls with the same key before it is captured (at least 2).
        min_free_bytes: device-free memory floor checked before each capture; 0 disables it.
        pool_budget_bytes: a byte budget for the encoder's graphs beside the graph count:
            once the graphs it holds took this much at capture (allocator growth across
            each capture plus its static buffers, the ``pool_memory`` figure), no new shape
            is admitted (a ``capacity`` miss, detail ``budget``). ``max_graphs`` stays the
            ceiling: raise it too (say to 64) to let the budget decide how many shapes fit.
            The last graph admitted may take the total past the budget by its own size (a
            capture's memory is known only after it). With a budget, a capture is also
            deferred while device-free memory holds less than the key's eager calls took
            at their peak and an eighth more (a ``memory`` miss, detail ``need``; not where
            the shared pool the capture would use holds a graph of inputs at least as
            large in every dimension, whose memory holds it, compile off): a
            capture cannot use the allocator's cache that served them, and an allocation
            failing inside it is fatal. 0: no budget. Not set (default):
            ``DEFAULT_POOL_BUDGET_BYTES`` (2 GiB) when ``max_graphs`` is not set either,
            and no budget when it is, so an explicit ``max_graphs`` alone is a plain
            graph count.
        share_pools: share one memory pool and capture stream per encoder, device and
            replay stream (false gives every graph its own, for an A/B comparison).
        expandable_pools: captures allocate in PyTorch's expandable segments (the caching
            allocator's ``expandable_segments``, switched on for the capture alone, and
            left as it is where the process configured it): a shared pool is then one
            growing range, so a larger shape's capture reuses blocks smaller ones freed in
            it, where fixed segments sized for the smaller shapes' tensors cannot hold the
            larger's and the pool grows by the larger capture's whole size. On by default
            (MiniCPM-o's vision graphs through ``vllm serve`` on an H100: 16 graphs in
            1.27 GiB, against 13 in 2.27 GiB without). Native allocator only (not
            ``cudaMallocAsync``); elsewhere it changes nothing.
        compile: capture ``torch.compile(forward)`` (inductor's fused kernels, default mode)
            per exact shape instead of the eager forward; misses still run the eager
            forward. Off by default. Inside vLLM a compile never runs on a request's path:
            the shapes ``prepare_from`` names are compiled at start-up, and shapes first
            seen while serving are captured from the eager forward.
        background_capture: warm up (and, with ``compile``, compile) a graph's forward on a
            background thread (a compile on a side stream) while calls of its shape keep running
            eagerly (``warmup`` misses, detail ``preparing``); the next call of the shape
            then captures on its own thread, skipping the eager warm-up (one compiled call
            with ``compile``), and is served by the graph. The stream capture stays on the
            calling thread because CUDA forbids a device synchronisation or another graph
            recording beside it in other threads. Off by default: the call that reaches
            ``min_capture_calls`` warms up, captures and is served by the graph. Torch
            backend only (vLLM's manager captures in CUDA's global mode, which the
            preparation thread's allocations would break). With ``compile`` too, only where
            no other thread calls torch.compile'd code: PyTorch's FX tracing flag is
            process-wide, so such a call raises while the preparation thread compiles. While
            it compiles, the interpreter's GIL switch interval is 0.1 ms (restored after),
            and the compiling thread pauses while any adapter's eager call is in flight (at
            most 20 ms at a time, then it runs 2 ms), so serving threads are not starved
            behind the compile.
        device_timing: time eager and replayed calls on the device with CUDA events,
            recorded without a host sync and resolved off the call path into
            ``DeviceTimed`` events. Off by default (host time only).
        skip_profiling: while the adapter is in the ``profiling`` phase (vLLM's start-up
            profiling run), calls run eagerly as ``ineligible`` misses (detail
            ``profiling``) and never enter the admission history or take a graph slot.
        audio_attention: how a Qwen2.5-Omni audio tower without flash attention attends
            inside its graphed forward. ``"native"`` (default): transformers' per-chunk
            loop, which syncs with the host, so where the backend really captures such calls
            stay eager (``attention_backend``). ``"masked"``: one SDPA over the packed
            chunks with a block-diagonal mask built on the device, which graphs; it is not
            bitwise transformers' result (measured: float32 within 1e-6, bfloat16 within
            2**-7), and every call the adapter serves uses it, hits and misses alike.
        prepare_from: event logs of an earlier run (a path or a glob pattern, such as
            ``/var/log/omnitrace/events-*.jsonl``; rotated files are read too): inside
            vLLM, once the engine has warmed up and before it serves, each encoder captures
            the shapes its namesake captured there (the largest first, so smaller
            graphs reuse the larger ones' pool memory, where their recorded captures fit
            the pool budget together; else the most replayed first), under the same cap,
            budget and memory floor, so their first requests replay a graph (and, with
            ``compile``, a compiled one). A pattern that matches nothing prepares nothing
            and logs one line. Empty (default): nothing is prepared.
        split_items: serve a call that carries several items as one call per item, so
            each item's shape is its own graph key: the batches vLLM forms under concurrent
            traffic, whose mixes of items seldom repeat, replay the graphs of the items'
            shapes instead of missing as new shapes. Qwen2.5-Omni: each image, each clip;
            an item's result is its own forward's, which may differ from the batched
            forward's in the last bits, as two of vLLM's batch mixes may. MiniCPM-o: each
            audio slice at its own length, with the result vLLM's method gives it alone
            (batched, a slice shorter than the longest sees part of its padding); its
            vision keeps its batches. Each item is one call in the stats and events. Off by
            default.
    """

    enabled: bool = True
    max_graphs: int = _UNSET
    min_capture_calls: int = 2
    min_free_bytes: int = GiB
    pool_budget_bytes: int = _UNSET
    share_pools: bool = True
    expandable_pools: bool = True
    compile: bool = False
    background_capture: bool = False
    device_timing: bool = False
    skip_profiling: bool = False
    audio_attention: str = "native"
    prepare_from: str = ""
    split_items: bool = False

    def __post_init__(self) -> None:
        counted = self.max_graphs is not _UNSET
        if not counted:
            object.__setattr__(self, "max_graphs", DEFAULT_MAX_GRAPHS)
        if self.pool_budget_bytes is _UNSET:
            budget = 0 if counted else DEFAULT_POOL_BUDGET_BYTES
            object.__setattr__(self, "pool_budget_bytes", budget)
        check_bool(_FIELD_TO_KEY["enabled"], self.enabled)
        check_int(
            _FIELD_TO_KEY["max_graphs"],
            self.max_graphs,
            maximum=MAX_GRAPHS_CAP,
            meaning=f"an integer from 0 to {MAX_GRAPHS_CAP} (0 keeps no graph)",
        )
        check_int(
            _FIELD_TO_KEY["min_capture_calls"],
            self.min_capture_calls,
            minimum=2,
            meaning="an integer from 2 to 2**63-1",
        )
        check_int(
            _FIELD_TO_KEY["min_free_bytes"],
            self.min_free_bytes,
            meaning="a number of bytes from 0 to 2**63-1 (0 disables the check)",
        )
        check_int(
            _FIELD_TO_KEY["pool_budget_bytes"],
            self.pool_budget_bytes,
            meaning="a number of bytes from 0 to 2**63-1 (0: no budget)",
        )
        for name in (
            "share_pools",
            "expandable_pools",
            "compile",
            "background_capture",
            "device_timing",
            "skip_profiling",
            "split_items",
        ):
            check_bool(_FIELD_TO_KEY[name], getattr(self, name))
        if not isinstance(self.audio_attention, str) or (
            self.audio_attention not in AUDIO_ATTENTION_ROUTES
        ):
            accepted = " or ".join(repr(route) for route in AUDIO_ATTENTION_ROUTES)
            raise ConfigError(
                f"{_FIELD_TO_KEY['audio_attention']}: expected {accepted}, "
                f"got {describe(self.audio_attention)}"
            )
        if not isinstance(self.prepare_from, str) or (
            self.prepare_from and not self.prepare_from.strip()
        ):
            raise ConfigError(
                f"{_FIELD_TO_KEY['prepare_from']}: expected a path or a glob pattern of "
                f"event logs, or an empty string for none, got {describe(self.prepare_from)}"
            )
        if self.prepare_from:
            check_name(_FIELD_TO_KEY["prepare_from"], self.prepare_from)

    @property
    def history_size(self) -> int:
        """Keys remembered by admission: four times ``max_graphs``."""
        return 4 * self.max_graphs

    @property
    def by_default_budget(self) -> bool:
        """Whether the cap and the budget are the defaults for neither being set."""
        return (self.max_graphs, self.pool_budget_bytes) == (
            DEFAULT_MAX_GRAPHS,
            DEFAULT_POOL_BUDGET_BYTES,
        )

    @property
    def captures_enabled(self) -> bool:
        """Whether any call can ever be captured."""
        return self.enabled and self.max_graphs > 0

    @classmethod
    def from_hf_overrides(
        cls,
        overrides: Mapping[str, Any] | str | None,
        *,
        enforce_eager: bool = False,
        warn: Callable[[str], None] | None = None,
    ) -> EncoderGraphConfig:
        """Build a config from the parsed ``--hf-overrides`` (a mapping or its JSON text).

        Other keys belong to the model and are ignored, except misspellings of omnitrace's
        (see :func:`misspelt_key`): an unknown ``encoder_cuda_graph_*`` key, the prefix
        spelt another way (vLLM's ``encoder_cudagraph_*``, other case or separators) or a
        near miss of a whole key (``encoder_cuda_grph_max_graphs``) is an error, since no
        model reads such a key; a bare option name (``max_graphs``) or a looser match may be
        the model's own, so it is left to the model with one warning naming the right key.

        Args:
            overrides: the parsed ``--hf-overrides`` or its JSON text; None for none.
            enforce_eager: vLLM's ``--enforce-eager`` (forces ``enabled`` false).
            warn: called with each warning line; None logs it on this module's logger.

        Raises:
            ConfigError: a value has the wrong type or range, the JSON does not parse (too
                deep or too long a number included), or a key is unknown or misspelt (the
                message suggests the closest valid key). Always one line.
        """
        if not isinstance(enforce_eager, bool):
            raise ConfigError(
                f"enforce_eager: expected true or false, got {describe(enforce_eager)}"
            )
        overrides = parse_hf_overrides(overrides)

        kwargs: dict[str, Any] = {}
        warnings: list[str] = []
        for key, value in overrides.items():
            if not isinstance(key, str):
                continue
            field_name = HF_OVERRIDE_KEYS.get(key)
            if field_name is not None:
                kwargs[field_name] = value
                continue
            found = misspelt_key(key)
            if found is None:
                continue
            message, fatal = found
            if fatal:
                raise ConfigError(message)
            warnings.append(message)
        config = cls(**kwargs)
        # Said once the values are valid: a run refused for a bad value shows one line.
        for message in warnings:
            if warn is None:
                logger.warning("omnitrace: hf_overrides: %s", message)
            else:
                warn(message)
        if enforce_eager and config.enabled:
            config = config.replace(enabled=False)
        return config

    def replace(self, **changes: Any) -> EncoderGraphConfig:
        """Return a copy with ``changes`` applied and validated.

        Args:
            **changes: field names and their new values. A ``max_graphs`` given without a
                ``pool_budget_bytes`` on a config with the default pair drops the default
                budget, as setting the cap alone would have from the start.

        Returns:
            A new config; this one is unchanged.

        Raises:
            ConfigError: a name is not a field, or a value is invalid.
        """
        known = {f.name for f in fields(self)}
        for name in changes:
            if name not in known:
                raise ConfigError(
                    f"{safe(name)}: not an EncoderGraphConfig field "
                    f"(valid: {', '.join(sorted(known))})"
                )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if (
            "max_graphs" in changes
            and "pool_budget_bytes" not in changes
            and (self.by_default_budget)
        ):
            # The default budget came with the default cap: a cap set now stands alone,
            # as it would have from the start.
            values["pool_budget_bytes"] = _UNSET
        values.update(changes)
        return EncoderGraphConfig(**values)

    def to_hf_overrides(self) -> dict[str, Any]:
        """Return the ``--hf-overrides`` mapping that rebuilds this config."""
        return {key: getattr(self, name) for key, name in HF_OVERRIDE_KEYS.items()}


def _normal(key: str) -> str:
    """``key`` in lower case without separators: the spelling that misspellings share."""
    return "".join(char for char in key.lower() if char.isalnum())


_NORMAL_PREFIX = _normal(_PREFIX)
_NORMAL_KEYS = {_normal(key): key for key in HF_OVERRIDE_KEYS}
#: The option names without the prefix (``max_graphs``), normalised, mapped to their keys.
_BARE_KEYS = {_normal(key[len(_PREFIX) + 1 :]): key for key in HF_OVERRIDE_KEYS if key != _PREFIX}
#: vLLM's own encoder graph settings: fields of its compilation config, which a key of the
#: same name in --hf-overrides never reaches.
_VLLM_COMPILATION_KEYS = frozenset(
    {
        "encoder_cudagraph_token_budgets",
        "encoder_cudagraph_max_images_per_batch",
        "encoder_cudagraph_max_vision_items_per_batch",
        "encoder_cudagraph_max_frames_per_batch",
    }
)
#: How alike (difflib's ratio, on normalised keys) a key must be to one of omnitrace's to be
#: refused as its misspelling, or to be warned about. The model keys of the supported models
#: (``encoder_layers``, ``audio_config``...) stay below the warning level.
_REFUSED_RATIO = 0.85
_WARNED_RATIO = 0.75
#: Keys longer than this are compared by their prefix only: none of omnitrace's comes close.
_COMPARED_CHARS = 80


def _closest(normal: str, choices: Mapping[str, str], cutoff: float) -> tuple[str, float] | None:
    """The key of ``choices`` whose normalised spelling is closest to ``normal``, and how close."""
    close = difflib.get_close_matches(normal, list(choices), n=1, cutoff=cutoff)
    if not close:
        return None
    return choices[close[0]], difflib.SequenceMatcher(None, normal, close[0]).ratio()


def spelt_like_a_key(key: str) -> bool:
    """Whether ``key`` starts with omnitrace's prefix in any case and with any separators
    (``encoder_cudagraph_max_graphs``): a key no model has, so surely meant for omnitrace."""
    return _normal(key[: _COMPARED_CHARS * 4]).startswith(_NORMAL_PREFIX)


def misspelt_key(key: str) -> tuple[str, bool] | None:
    """Say whether ``key``, which is not one of omnitrace's keys, looks like a misspelling.

    Returns:
        None for a key that is not like any of omnitrace's (the model's), else one line
        naming the key and the right one, and whether the key is surely meant for omnitrace
        (an unknown ``encoder_cuda_graph_*`` key, the prefix spelt another way, or a near
        miss of a whole key: an error) or may be the model's own (a bare option name such as
        ``max_graphs``, or a looser match: a warning).
    """
    if key in HF_OVERRIDE_KEYS:
        return None
    if key.startswith(_PREFIX):
        return _unknown_key(key), True
    normal = _normal(key[: _COMPARED_CHARS * 4])
    shown = _shown(key)
    if spelt_like_a_key(key):
        note = "omnitrace's keys are spelt encoder_cuda_graph_*"
        if key in _VLLM_COMPILATION_KEYS:
            note = (
                "this is vLLM's own encoder graph setting, which goes in --compilation-config; "
                + note
            )
            return f"{shown}: unknown encoder graph option ({note}; valid: {_VALID})", True
        right = _NORMAL_KEYS.get(normal)
        if right is None and len(key) <= _COMPARED_CHARS:
            rest = _closest(normal[len(_NORMAL_PREFIX) :], _BARE_KEYS, 0.6)
            right = None if rest is None else rest[0]
        if right is None:
            return f"{shown}: unknown encoder graph option ({note}; valid: {_VALID})", True
        return f"{shown}: unknown encoder graph option ({note}); did you mean {right!r}?", True
    if len(key) > _COMPARED_CHARS:
        return None
    whole = _closest(normal, _NORMAL_KEYS, _WARNED_RATIO)
    if whole is not None and whole[1] >= _REFUSED_RATIO:
        return f"{shown}: unknown encoder graph option; did you mean {whole[0]!r}?", True
    bare = _BARE_KEYS.get(normal)
    if bare is None and len(normal) >= 6:
        near = _closest(normal, _BARE_KEYS, 0.8)
        bare = None if near is None else near[0]
    right = bare if bare is not None else (None if whole is None else whole[0])
    if right is None:
        return None
    return (
        f"{shown}: not an encoder graph option, so omnitrace leaves it to the model; "
        f"did you mean {right!r}?",
        False,
    )


_VALID = ", ".join(sorted(HF_OVERRIDE_KEYS))


def _shown(key: str) -> str:
    """``key`` as a message shows it: escaped, and shortened past 80 characters."""
    if len(key) > _COMPARED_CHARS:
        return describe(key).rsplit(" (", 1)[0]
    # The key is the user's text: a new line in it must not split the message.
    return safe(key)


def _unknown_key(key: str) -> str:
    """Say that ``key`` is no encoder graph option, suggesting the closest one."""
    if len(key) > _COMPARED_CHARS:
        return f"{_shown(key)}: unknown encoder graph option (valid: {_VALID})"
    # Compare what follows the shared prefix, or every key looks alike.
    suffixes = {k[len(_PREFIX) :]: k for k in HF_OVERRIDE_KEYS if k != _PREFIX}
    close = difflib.get_close_matches(key[len(_PREFIX) :], list(suffixes), n=1, cutoff=0.6)
    hint = f"; did you mean {suffixes[close[0]]!r}?" if close else ""
    return f"{_shown(key)}: unknown encoder graph option (valid: {_VALID}){hint}"


def parse_hf_overrides(overrides: Mapping[str, Any] | str | None) -> Mapping[str, Any]:
    """Return ``--hf-overrides`` as a mapping: parsed from its JSON text, ``{}`` for None.

    Raises:
        ConfigError: the JSON does not parse, or is not an object. Always one line.
    """
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        overrides = _parse_json(overrides)
    if not isinstance(overrides, Mapping):
        raise ConfigError(
            f"hf_overrides: expected a JSON object (mapping), got {describe(overrides)}"
        )
    return overrides


def _parse_json(text: str) -> Any:
    """Parse ``--hf-overrides`` text; every failure is a one-line ConfigError."""
    if not text.strip():
        return {}
    try:
        # Long integers stay unconverted: a key omnitrace ignores may hold one, and one of
        # ours is then refused by its range check.
        return json.loads(text, parse_int=_parse_json_int)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"hf_overrides: expected a JSON object, got invalid JSON ({exc})"
        ) from None
    except RecursionError:
        raise ConfigError(
            "hf_overrides: expected a JSON object, got JSON nested too deeply to parse"
        ) from None
    except ValueError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"hf_overrides: expected a JSON object, got {reason}") from None
