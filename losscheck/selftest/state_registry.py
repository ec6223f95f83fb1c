"""The recurrent-state mutants: the catalogue's entries for a hybrid target
(`losscheck.selftest.state_bugs`), each shaped like a bug shipped in 2026 (docs/hybrid-targets.md).

They plant on a target with recurrent layers only (`losscheck mutants --target
fixtures/hybrid_target --drafter fixtures/hybrid_drafter_a`; on an attention-only target planting
one is a usage error). Every one changes greedy output, so each shows in greedy cells: of any
drafter but the self-draft oracle (which never rejects), in the serving axis the bug lives on.
"""

from __future__ import annotations

from collections.abc import Callable

from losscheck.core.contract import Target
from losscheck.core.ragged import RaggedLM
from losscheck.core.recurrent import RaggedStateCache
from losscheck.core.target import HFTarget
from losscheck.errors import OptionError
from losscheck.plan.cell import ENGINE, ORACLE, Cell
from losscheck.selftest import state_bugs
from losscheck.selftest.registry import GREEDY_NO_LAW, Mutant
from losscheck.serving.prefix_cache import PrefixCache


def _rolled_back(cell: Cell, horizon: int) -> bool:
    """Greedy cells of a drafter that rejects: each rejection is a rollback."""
    return cell.params.greedy and cell.drafter not in (ORACLE, ENGINE)


def _along(**axis: object) -> Callable[[Cell, int], bool]:
    """`_rolled_back` cells served along `axis` (e.g. prefix="warm")."""
    return lambda cell, horizon: _rolled_back(cell, horizon) and all(cell.axis(a) == v for a, v in axis.items())


def _cache(bug: str) -> Callable[[Target, int], Target]:
    """(target, k) -> a copy of the hybrid `target` whose batches get the cache of `bug`."""
    cls: type[RaggedStateCache] = state_bugs.STATE_BUGS[bug]

    def planted(target: Target, k: int) -> Target:
        if not isinstance(target, HFTarget) or not target.stateful:
            raise OptionError(
                f"mutant {bug} plants a recurrent-state bug; target {getattr(target, 'name', target)!r} has no "
                "recurrent layers (run it with --target fixtures/hybrid_target --drafter fixtures/hybrid_drafter_a)"
            )
        kinds = target.kinds
        return target.with_lm(RaggedLM(target.model, lambda rows, capacity: cls(rows, capacity, kinds)))

    return planted


def _prefix(bug: str) -> Callable[[PrefixCache], PrefixCache]:
    return lambda cache: state_bugs.PREFIX_BUGS[bug](cache.block, cache.capacity)


def _zero_draft_stale() -> Mutant:
    planted = state_bugs.ZeroDraftStale()  # one plant: its drafter and target halves share the counts
    return Mutant(
        "zero_draft_stale_state",
        "greedy",
        "A step with zero drafts reads a stale recurrent-state slot (n-gram drafting on hybrid models).",
        "A row that proposed nothing keeps the state from before its step: the pending token's update is lost "
        "from every recurrent layer while the attention layers hold it. Shows in the draft-gaps cells only (no "
        "other cell has a row without drafts).",
        _along(gaps=3),
        None,
        GREEDY_NO_LAW,
        wrap_drafter=planted.wrap_drafter,
        wrap_target=planted.wrap_target,
    )


STATE_CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "state_not_rolled_back",
        "greedy",
        "Recurrent state never rolled back after a rejection (a non-trimmable cache; mlx-lm #1109).",
        "The rejected drafts stay in every recurrent layer's state while the attention layers' keys and values "
        "are cropped. Shows in every greedy cell of a drafter that rejects.",
        _rolled_back,
        None,
        GREEDY_NO_LAW,
        wrap_target=_cache("state_not_rolled_back"),
    ),
    Mutant(
        "state_rollback_one_off",
        "greedy",
        "Recurrent state rolled back one position late (the first rejected draft kept).",
        "The state holds one token more than the keys and values after every rejection. Shows in every greedy "
        "cell of a drafter that rejects.",
        _rolled_back,
        None,
        GREEDY_NO_LAW,
        wrap_target=_cache("state_rollback_one_off"),
    ),
    Mutant(
        "state_slot_not_zeroed",
        "greedy",
        "A reused batch slot keeps its previous request's recurrent state (continuous batching with state slots).",
        "A request admitted into a finished row starts from the old request's state instead of zeros. Shows in "
        "the continuous-batching cells.",
        _along(batching="continuous"),
        None,
        GREEDY_NO_LAW,
        wrap_target=_cache("state_slot_not_zeroed"),
    ),
    _zero_draft_stale(),
    Mutant(
        "prefix_hit_zeroes_conv",
        "greedy",
        "A prefix-cache hit resumes the SSM state with the short convolution's window zeroed (SGLang #34043).",
        "Every request resumed from a cached block reads a zero conv window. Shows in the warm prefix-cache cells.",
        _along(prefix="warm"),
        None,
        GREEDY_NO_LAW,
        prefix_cache=_prefix("prefix_hit_zeroes_conv"),
    ),
    Mutant(
        "prefix_state_after_round",
        "greedy",
        "A block's state checkpoint taken after the whole scored block, dropped drafts included (vLLM #48375).",
        "The state manager ignores the rejected draft block: a request resuming from the block reads a state "
        "that holds tokens it never committed. Shows in the warm prefix-cache cells.",
        _along(prefix="warm"),
        None,
        GREEDY_NO_LAW,
        prefix_cache=_prefix("prefix_state_after_round"),
    ),
    Mutant(
        "prefix_state_one_early",
        "greedy",
        "A state checkpoint published one token before the block boundary the attention layers resume from "
        "(vLLM #58042).",
        "The recurrent layers miss the block's last token on every hit. Shows in the warm prefix-cache cells.",
        _along(prefix="warm"),
        None,
        GREEDY_NO_LAW,
        prefix_cache=_prefix("prefix_state_one_early"),
    ),
)
