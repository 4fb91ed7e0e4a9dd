"""The warm start's imperfect teacher: the carry slip and how demonstrations are drawn."""

import random

from hybridrl.data.arithmetic import arithmetic_splits, carry_slip
from hybridrl.job.sft import sample_sft_batch


def test_carry_slip_hand_derived():
    assert carry_slip(37, "+", 45) == 72  # 7+5 carries: 82 written as 72
    assert carry_slip(95, "+", 15) == 100  # 110 with the units carry forgotten
    assert carry_slip(9, "+", 1) == 0
    assert carry_slip(34, "+", 45) is None  # 4+5 = 9: nothing to forget
    assert carry_slip(37, "-", 45) is None and carry_slip(37, "*", 45) is None


def test_every_example_knows_its_slip():
    train, _ = arithmetic_splits(num_digits=2, operations="+-", train_size=400, eval_size=20, seed=11)
    for ex in train:
        a, b = (int(x) for x in ex.prompt.rstrip("=").replace("-", "+").split("+"))
        carries = "+" in ex.prompt and a % 10 + b % 10 >= 10
        assert (ex.slip is not None) == carries
        if carries:
            assert int(ex.slip) == int(ex.answer) - 10 and ex.slip != ex.answer


def _pairs(n: int, rng: random.Random):
    prompts = [[rng.randrange(5, 19) for _ in range(4)] for _ in range(n)]
    answers = [[rng.randrange(5, 15), 2] for _ in range(n)]
    slips = [None if i % 3 == 0 else [answers[i][0] + 1, 2] for i in range(n)]  # always differs
    return prompts, answers, slips


def test_slip_rate_zero_draws_the_slip_free_batches():
    prompts, answers, slips = _pairs(50, random.Random(0))
    seed = random.randrange(1 << 30)
    plain = sample_sft_batch(random.Random(seed), prompts, answers, 64)
    none = sample_sft_batch(random.Random(seed), prompts, answers, 64, slips=slips, slip_rate=0.0,
                            slip_rng=random.Random(1))
    assert plain == none


def test_slips_replace_only_slippable_rows_at_the_rate_and_leave_batches_unchanged():
    prompts, answers, slips = _pairs(60, random.Random(1))
    seed = random.randrange(1 << 30)
    rate = 0.7
    rng_a, rng_b, slip_rng = random.Random(seed), random.Random(seed), random.Random(seed + 1)
    slipped = total = 0
    for _ in range(200):
        p_plain, a_plain, _ = sample_sft_batch(rng_a, prompts, answers, 32)
        p, a, _ = sample_sft_batch(rng_b, prompts, answers, 32, slips=slips, slip_rate=rate, slip_rng=slip_rng)
        assert p == p_plain  # the same prompts: the slip draws use their own stream
        for prompt, got, want in zip(p, a, a_plain):
            i = prompts.index(prompt)
            if slips[i] is None:
                assert got == want
            else:
                total += 1
                assert got in (want, slips[i])
                slipped += got == slips[i]
    assert abs(slipped / total - rate) < 0.05  # ~4,000 draws: 5 standard errors
    every = sample_sft_batch(random.Random(seed), prompts, answers, 64, slips=slips, slip_rate=1.0,
                             slip_rng=random.Random(2))
    for prompt, got in zip(*every[:2]):
        i = prompts.index(prompt)
        assert got == (answers[i] if slips[i] is None else slips[i])
