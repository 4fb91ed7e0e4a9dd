"""A user reward for the pipeline tests (named by path): a deterministic function of the
response text with spread inside most groups, so the tiny model's updates are not zero
(an untrained tiny model answers few arithmetic prompts right: exact_match often scores a
whole batch 0). Pure and instant, so marked trusted: the runner calls it inline, in the thread
that scores, with no worker processes."""


def score(response, answer, prompt):
    return (sum(map(ord, response)) % 7) / 6


score.hybridrl_trusted = True
