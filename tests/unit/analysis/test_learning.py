"""The frontier's learning ratio (thinpipe/analysis/learning.py), on a hand-computed Dense curve."""

from thinpipe.analysis import learning_ratio

DENSE = [(0, 2.0), (20, 1.6), (40, 1.4), (60, 1.3)]


def test_the_step_dense_reaches_the_arms_final_loss_over_the_arms_steps():
    assert learning_ratio(DENSE, 1.5, 60) == 0.5          # 20 + 20 x (1.6 - 1.5) / (1.6 - 1.4) = 30 of 60
    assert learning_ratio(DENSE, 1.4, 60) == 40 / 60      # on an evaluation
    assert learning_ratio(DENSE, 1.3, 60) == 1.0          # the arm ends where Dense ends
    assert learning_ratio(DENSE, 2.5, 60) == 0.0          # worse than the start
    assert learning_ratio(DENSE, 1.2, 60) is None         # below Dense's end: Dense never gets there
    assert learning_ratio(list(reversed(DENSE)), 1.5, 60) == 0.5  # the points' order does not matter
