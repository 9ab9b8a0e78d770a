"""A model sharded by fullshard trains exactly like the same model in one process."""

import pytest
from harness.compare import reference_gaps, train_against_reference

from fullshard import FSDP2Engine
from fullshard.testing import ZOO, run_distributed
from fullshard.testing.zoo import TIED

TOL = 1e-5


def _zoo_parity(names):
    engine = FSDP2Engine({"mixed_precision": "fp32"})
    return {name: train_against_reference(name, engine.prepare_model) for name in names}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_zoo_model_matches_single_process(world_size):
    results = run_distributed(_zoo_parity, world_size, sorted(ZOO))
    problems = []
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            loss_diff, norm_diff = reference_gaps(r)
            if loss_diff > TOL or norm_diff > TOL or r["max_weight_diff"] > TOL or r["missing"]:
                problems.append(f"rank {rank} {name}: loss {loss_diff:.2e} norm {norm_diff:.2e} "
                                f"weights {r['max_weight_diff']:.2e} ({r['worst_weight']}) missing {r['missing']}")
            if name in TIED and not all(r["tied"]):
                problems.append(f"rank {rank} {name}: tie broken at steps {[i for i, t in enumerate(r['tied']) if not t]}")
            if r["loss"][-1] >= r["loss"][0]:
                problems.append(f"rank {rank} {name}: loss did not fall {r['loss']}")
    assert not problems, "\n".join(problems)
