"""Per-model routing state: block size, tokenizer, embedded tracker and index, busy thresholds (the
thresholds are data here; the checks that use them are ``frontend/routing/eligibility.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from frontend.request.validation import PromptLimit
from kvroute_common.constants import DEFAULT_TENANT as TENANT
from kvroute_common.multimodal import ImageContext, ImageOptions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from frontend.pool.workers import Worker
    from frontend.routing.turn_memo import TurnMemo
    from indexer.approx import ApproxIndex
    from indexer.core import KvIndex
    from indexer.registry import IndexerRegistry
    from slot_tracker.core import SlotRegistry, SlotTracker


@dataclass(slots=True)
class BusyThresholds:
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    active_prefill_tokens_threshold_frac: float | None = None

    @property
    def enabled(self) -> bool:
        return (
            self.active_decode_blocks_threshold is not None
            or self.active_prefill_tokens_threshold is not None
            or self.active_prefill_tokens_threshold_frac is not None
        )

    def to_dict(self, model: str) -> dict:
        """The router guide's /busy_threshold shape; the 1.6.1 ``_frac`` field only once it is set
        (the guide's examples show the two fields, the 1.6.1 binary adds the third)."""
        out = {
            "model": model,
            "active_decode_blocks_threshold": self.active_decode_blocks_threshold,
            "active_prefill_tokens_threshold": self.active_prefill_tokens_threshold,
        }
        if self.active_prefill_tokens_threshold_frac is not None:
            out["active_prefill_tokens_threshold_frac"] = self.active_prefill_tokens_threshold_frac
        return out


def validate_update(decode: object, prefill: object, frac: object) -> None:
    """ValueError with the reason when a /busy_threshold update is out of range."""
    if decode is not None:
        if (
            not isinstance(decode, (int, float))
            or isinstance(decode, bool)
            or not math.isfinite(decode)
            or not 0.0 <= decode <= 1.0
        ):
            raise ValueError("active_decode_blocks_threshold must be between 0.0 and 1.0")
    if prefill is not None:
        if not isinstance(prefill, int) or isinstance(prefill, bool) or prefill < 0:
            raise ValueError("active_prefill_tokens_threshold must be a non-negative integer")
    if frac is not None:
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not math.isfinite(frac) or frac < 0:
            raise ValueError("active_prefill_tokens_threshold_frac must be a non-negative finite number")


class ModelEntry:
    """One served model. Exists while at least one registered worker serves it."""

    __slots__ = (
        "name",
        "block_size",
        "tokenizer",
        "workers",
        "thresholds",
        "approx",
        "base",
        "lora_name",
        "_slots",
        "_events",
        "image_options",
        "_turns",
    )

    def __init__(
        self,
        name: str,
        block_size: int,
        tokenizer: PreTrainedTokenizerBase,
        slots: SlotRegistry,
        events: IndexerRegistry | None,
        approx: ApproxIndex | None,
        thresholds: BusyThresholds,
        base: str | None = None,
        image_options: ImageOptions | None = None,
    ) -> None:
        self.name = name
        self.image_options = image_options or ImageOptions()
        # a LoRA adapter of model ``base``: its blocks are the base model's KV cache, hashed with the
        # adapter's name as the engine's events are, and its requests load the base model's workers
        self.base = base or name
        self.lora_name = name if base is not None and base != name else None
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.workers: dict[int, Worker] = {}
        self.thresholds = thresholds
        self.approx = approx  # indexer.approx.ApproxIndex in approximate mode, else None
        self._slots = slots  # slot_tracker.core.SlotRegistry
        self._events = events  # the embedded IndexerRegistry (KV events mode) or None
        self._turns: TurnMemo | None = None

    @property
    def turns(self) -> TurnMemo:
        """This model's recent completions prompts, reused by their next turn (built on first use: it
        needs the tokenizer's encoder)."""
        if self._turns is None:
            from frontend.routing.turn_memo import TurnMemo
            from kvroute_common.tokenizer import prompt_encoder

            self._turns = TurnMemo(prompt_encoder(self.tokenizer), self.block_size, self.lora_name)
        return self._turns

    @property
    def turns_in_use(self) -> TurnMemo | None:
        """The turn memo once a prompt went through it (metrics read it without building one)."""
        return self._turns

    @property
    def tracker(self) -> SlotTracker | _EmptyTracker:
        """This model's slot tracker (the registry owns it; an external /unregister may drop it)."""
        t = self._slots.get(self.base, TENANT)
        return _EMPTY_TRACKER if t is None else t

    @property
    def index(self) -> ApproxIndex | KvIndex | None:
        """Where overlaps come from: the predicted index, the event-fed index, or None."""
        if self.approx is not None:
            return self.approx
        if self._events is not None:
            return self._events.index(self.base, TENANT)
        return None

    def image_context(self, fetched: Mapping[str, bytes] | None = None) -> ImageContext | None:
        """How this model's images are keyed (None: a text model, or no engine has said which model it
        loaded): the layout of its tokenizer's model and the id vLLM hashes images with."""
        from kvroute_common.tokenizer import image_layout

        layout = image_layout(self.tokenizer)
        if layout is None:
            return None
        opts = self.image_options
        model_id = opts.model_id
        if model_id is None:
            roots = [w.model_roots.get(self.base) for w in self.workers.values()]
            model_id = next((r for r in roots if r), None)
            if model_id is None:
                return None
        return ImageContext(layout, model_id, opts.algorithm, fetched, opts.max_bytes)

    def known_worker_ids(self) -> set[int]:
        return set(self.workers)

    @property
    def ready(self) -> bool:
        return any(w.healthy for w in self.workers.values())

    def prompt_limit(self) -> PromptLimit | None:
        """The limits of the healthy worker that takes the longest prompt (None: some worker's are
        unknown, it may take anything): a prompt over it goes to no worker."""
        pool = [w for w in self.workers.values() if w.healthy] or list(self.workers.values())
        best: PromptLimit | None = None
        for w in pool:
            limit = w.prompt_limit
            if limit.tokens is None:
                return None
            if best is None or limit.tokens > (best.tokens or 0):
                best = limit
        return best

    def capacity(self) -> tuple[int | None, int | None]:
        """(total KV blocks, max batched tokens) summed / maxed over healthy workers, for gauges."""
        total = [w.num_gpu_blocks * w.spec.dp_size for w in self.workers.values() if w.num_gpu_blocks]
        mbt = [w.max_num_batched_tokens for w in self.workers.values() if w.max_num_batched_tokens]
        return (sum(total) if total else None, max(mbt) if mbt else None)


class _EmptyTracker:
    """Stand-in when the registry has no tracker for a model: nothing in flight anywhere."""

    block_size = 0

    def potential_loads(self, sequence_hashes, new_isl_tokens=0):
        return []

    def active_prefill_tokens(self, worker_id, dp_rank):
        return 0

    def active_decode_blocks(self, worker_id, dp_rank):
        return 0

    def add(self, *args, **kwargs):
        from slot_tracker.core import SlotTrackerError

        raise SlotTrackerError(404, "tracker not found")

    def prefill_complete(self, request_id):
        return None

    def add_output_block(self, request_id, expected_output_tokens=None, generated_tokens=0):
        return False

    def free(self, request_id):
        return False


_EMPTY_TRACKER = _EmptyTracker()
