"""Single-line bugs that once passed the whole suite, each reintroduced and caught.

Each mutant is a one-line source patch of a product function (compiled in its own module, and
swapped in wherever that function was imported by name); the test named for it must then fail.
A mutant whose line is no longer in the source fails here too: update it to the code's new form.
`make mutate` runs the same idea over every line of plugin/sampling/ and plugin/generation/.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from triton_sampling_mask.generation import engine
from triton_sampling_mask.sampling import normalisers

from . import test_serving_batches as batches
from . import test_speculative_drafts as drafts


@dataclass(frozen=True)
class Mutant:
    owner: object  # module or class holding the function
    name: str
    old: str
    new: str
    catching_test: object  # called with no arguments; must raise AssertionError under the mutant


MUTANTS = {
    "normaliser applies the first block's temperatures to every block": Mutant(
        normalisers,
        "normaliser_cpu",
        "scale[start:stop]",
        "scale[: stop - start]",
        lambda: batches.test_a_multi_block_batch_of_mixed_requests_at_32000("cpu", False),
    ),
    "GPU branch exp-sums half-precision logits in half precision": Mutant(
        normalisers,
        "normaliser_torch",
        "row_max.float().unsqueeze(1)",
        "row_max.to(logits.dtype).unsqueeze(1)",
        lambda: batches.test_half_precision_logits_sample_as_their_float32_values(torch.bfloat16, "gpu"),
    ),
    "no check for unusable logits at a drafted position": Mutant(
        engine,
        "_accepted",
        "(proposed != PAD) & ~unusable[:, :-1]",
        "(proposed != PAD)",
        lambda: drafts.test_unusable_logits_at_a_drafted_position_fail_as_plain_decoding_does("inf", 2),
    ),
    "stop ids and EOS checked only at the end of an accepted block": Mutant(
        engine.ContinuousEngine,
        "_emit",
        "stop = next((j for j in range(count) if tokens[j] in sequence.stop_set), None)",
        "stop = count - 1 if count and tokens[count - 1] in sequence.stop_set else None",
        lambda: drafts.test_a_stop_at_each_position_of_an_accepted_block_ends_there("eos", 1),
    ),
    "a step seeded with the next step's seed": Mutant(
        engine.ContinuousEngine,
        "_emit",
        "step_params(params, steps[owner] + within)",
        "step_params(params, steps[owner] + within + 1)",
        drafts.test_each_step_draws_with_its_own_step_seed,
    ),
}


def apply(mutant: Mutant, monkeypatch) -> None:
    """Swap in the mutated function: on its owner, and in every module of the package that holds
    the original under any name."""
    original = getattr(mutant.owner, mutant.name)
    source = textwrap.dedent(inspect.getsource(original))
    assert source.count(mutant.old) == 1, f"{mutant.name} no longer holds {mutant.old!r}"
    namespace: dict = {}
    code = compile(source.replace(mutant.old, mutant.new), inspect.getsourcefile(original), "exec")
    exec(code, original.__globals__, namespace)  # the module's globals: its imports resolve as before
    mutated = namespace[mutant.name]
    monkeypatch.setattr(mutant.owner, mutant.name, mutated)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("triton_sampling_mask"):
            for attribute, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, attribute, mutated)


@pytest.mark.parametrize("mutant", list(MUTANTS.values()), ids=list(MUTANTS))
def test_the_named_survivors_are_caught(mutant, monkeypatch):
    apply(mutant, monkeypatch)
    with pytest.raises(AssertionError):
        mutant.catching_test()
