"""Each generator's sampling stream comes from its id (generators/run_setup.py `generator_seed`):
distinct ids draw distinct streams, one id the same stream in every process."""

import os
import subprocess
import sys

from rollflash.broker.config.config import SimConfig
from rollflash.generators.run_setup import generator_seed
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine

PARAMS = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_new_tokens=64)


def _stream(generator_id: str) -> list[list[int]]:
    """The token ids a simulated engine seeded for `generator_id` draws for 8 samples."""
    sim = SimConfig(per_token_s=0.0001, length_median=16, length_sigma=1.0)
    engine = SimEngine(sim, seed=generator_seed(0, generator_id))
    return [list(s.response_ids) for s in engine.generate(["p"], PARAMS)[0]]


def test_ids_with_the_same_characters_draw_different_streams():
    # a sum of character codes would give both the same seed: "1" + "2" == "2" + "1"
    assert generator_seed(0, "gen-12") != generator_seed(0, "gen-21")
    assert _stream("gen-12") != _stream("gen-21")
    assert _stream("gen-12") == _stream("gen-12")


def test_one_id_draws_the_same_seed_in_every_process():
    # str hashing is salted per process unless PYTHONHASHSEED fixes it: two different salts
    code = "from rollflash.generators.run_setup import generator_seed as g; print(g(7, 'gen-12'))"
    seen = set()
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        seen.add(int(out.stdout))
    assert seen == {generator_seed(7, "gen-12")}


def test_the_seed_stays_within_what_numpy_and_vllm_accept():
    # 31 bits of the hash: 0 <= offset < 2**31, so seed + offset < 2**32 for seed < 2**31
    offsets = [generator_seed(0, f"gen-{i}") for i in range(200)]
    assert all(0 <= o < 2**31 for o in offsets) and len(set(offsets)) == 200
    assert generator_seed(5, "gen-3") == 5 + generator_seed(0, "gen-3")
