"""MoE under MTP, in the report's expert-parallel shape: the MTP loss honours the loss mask with routed experts and a
shared expert, expert parallel 2 on forked ranks (allgather and alltoall token dispatchers).

Without the aux (load-balancing) loss no gradient may change when masked positions are perturbed. With it on, the
aux loss averages router probabilities over every token, padding included, on either tree, so its gradient reaches
the routers and everything upstream of them: there only what the mask governs must stay exact (the logged MTP and LM
losses, and the gradients the aux loss cannot reach).
"""

import pytest

from tinymodel import moe
from tinymodel.reference import REL, changed_grads, reference_mtp_loss
from tinymodel.worker import launch


pytestmark = pytest.mark.slow


AUX = [pytest.param(0.0, id="aux_off"), pytest.param(moe.AUX_LOSS_COEFF, id="aux_on")]
DISPATCHERS = ["allgather", "alltoall"]


def outside_aux_reach(name: str) -> bool:
    """Parameters no load-balancing gradient reaches: the output layer, and what comes after the MTP layer's router
    without feeding it (its routed and shared experts, the MTP final norm). Aux gradients flow router -> router input
    -> everything upstream."""
    return name.startswith(("output_layer.", "mtp.layers.0.final_layernorm.")) or (
        name.startswith("mtp.layers.0.mtp_model_layer.mlp.") and ".router." not in name
    )


def _masked_ce(case: dict, batch: dict, mask_offset: int = 0) -> float:
    return reference_mtp_loss(case["step"].mtp_logits[0], batch["labels"], batch["loss_mask"], 1, mask_offset)


@pytest.fixture(scope="module")
def ep2_ranks(tree, tmp_path_factory):
    """Every dispatcher x aux case on 2 ranks, expert parallel 2, one job of forked ranks with this session's tree."""
    return launch("expert_parallel", tree, 2, tmp_path_factory.mktemp("expert_parallel"))


def _cases(ranks, dispatcher, aux):
    return [(rank["rank"], rank["batch"], rank["cases"][(dispatcher, aux)]) for rank in ranks]


class TestExpertParallel2:
    """The same checks with the experts split over 2 ranks; each rank has its own batch, so the logged MTP loss is
    the mean of the ranks' masked CEs (core averages it over the data-parallel group)."""

    def test_workers_ran_the_tree_under_test_with_experts_split(self, ep2_ranks, gpt_step_file):
        assert [r["gpt_step_file"] for r in ep2_ranks] == [gpt_step_file] * 2
        for rank in ep2_ranks:
            assert set(rank["cases"]) == set(moe.CASES)
            assert {case["local_experts"] for case in rank["cases"].values()} == {2}  # 4 experts over 2 ranks

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("dispatcher", DISPATCHERS)
    def test_every_gradient_is_unchanged_without_aux_loss(self, ep2_ranks, dispatcher):
        for rank, _, case in _cases(ep2_ranks, dispatcher, 0.0):
            changed = changed_grads(case["step"].grads, case["perturbed"].grads)
            assert changed == [], f"rank {rank}: {len(changed)} of {len(case['step'].grads)} gradients changed"

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("dispatcher", DISPATCHERS)
    def test_gradients_the_aux_loss_cannot_reach_are_unchanged_with_aux_loss(self, ep2_ranks, dispatcher):
        for rank, _, case in _cases(ep2_ranks, dispatcher, moe.AUX_LOSS_COEFF):
            changed = [n for n in changed_grads(case["step"].grads, case["perturbed"].grads) if outside_aux_reach(n)]
            assert changed == [], f"rank {rank}: {changed[:4]}"

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("aux", AUX)
    @pytest.mark.parametrize("dispatcher", DISPATCHERS)
    def test_logged_mtp_loss_is_the_masked_cross_entropy_averaged_over_ranks(self, ep2_ranks, dispatcher, aux):
        cases = _cases(ep2_ranks, dispatcher, aux)
        expected = sum(_masked_ce(case, batch) for _, batch, case in cases) / len(cases)
        for rank, _, case in cases:
            assert case["step"].mtp_losses[0] == pytest.approx(expected, rel=REL), f"rank {rank}"
            assert case["perturbed"].mtp_losses == case["step"].mtp_losses, f"rank {rank}"

    @pytest.mark.parametrize("aux", AUX)
    def test_alltoall_dispatch_matches_allgather(self, ep2_ranks, aux):
        """The alltoall dispatcher's CPU stand-ins change nothing it computes."""
        for (rank, _, gather), (_, _, to_all) in zip(
            _cases(ep2_ranks, "allgather", aux), _cases(ep2_ranks, "alltoall", aux)
        ):
            assert to_all["step"].lm_loss == pytest.approx(gather["step"].lm_loss, rel=REL), f"rank {rank}"
            assert to_all["step"].mtp_losses == pytest.approx(gather["step"].mtp_losses, rel=REL), f"rank {rank}"
            for name, grad in gather["step"].grads.items():
                assert to_all["step"].grads[name].allclose(grad, rtol=REL, atol=1e-7), f"rank {rank}: {name}"
