"""An example third-party plugin package for grpo-plugins.

It provides, through the ``grpo_plugins`` entry-point group only:

* the reward ``keyword_coverage`` (:mod:`grpo_plugins_example.rewards`),
* the loss type ``seq_mean_token_sum`` (:mod:`grpo_plugins_example.loss_type`),
* the importance-sampling strategy ``gspo_token`` (:mod:`grpo_plugins_example.importance_sampling`).
"""

from __future__ import annotations

__version__ = "0.1.0"
