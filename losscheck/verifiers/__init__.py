"""The verifier tier: any `Verifier` (`losscheck.core.verify`) driven with synthetic target
logits and drafts at millions of draws per minute, its output law tested exactly
(`losscheck.verifiers.tier`; docs/verifier-tier.md). Adapters that make other projects'
verification steps `Verifier`s live beside it (`losscheck.verifiers.hf`).

A verifier is named by a factory that takes no arguments and returns the `Verifier`, as
`--losscheck-verifier=pkg.mod:factory` and `losscheck verifier-tier --verifier pkg.mod:factory`
take it; `reference` is losscheck's own. A tree verifier (`losscheck.core.tree.TreeVerifier`) is named
the same way for `losscheck verifier-tier --tree` (`losscheck.verifiers.tree_tier`); `tree_reference`
is losscheck's own.
"""

from __future__ import annotations

from losscheck.core.tree import TreeVerifier, verify_tree
from losscheck.core.verify import Verifier, verify_block


def reference() -> Verifier:
    """`losscheck.verifiers:reference`: losscheck's own verifier, `verify_block`."""
    return verify_block


def tree_reference() -> TreeVerifier:
    """`losscheck.verifiers:tree_reference`: losscheck's own tree verifier, `verify_tree`."""
    return verify_tree
