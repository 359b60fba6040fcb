"""What is protected, and how much has been spent: local DP-SGD for every node of a decentralized run.

Every node clips its own per-sample gradients, adds its own Gaussian noise (local DP against its neighbours;
Abadi et al. 2016), Poisson-samples its own shard, and accounts for its own budget with Opacus's accountants
(RDP: Mironov 2017, Mironov, Talwar, Zhang 2019; PRV: Gopi et al. 2021). Every random draw privacy rests on comes
from :mod:`.noise` (ChaCha20 under a 256-bit key from OS entropy).

Building blocks, in the order a strategy calls them:

* :func:`check_private_model` / :class:`PerSampleGradients` - validate the model, attach per-sample gradient hooks;
* :func:`poisson_dataloader` - Poisson batches of the node's shard (empty batches included);
* :meth:`PerSampleGradients.clip_and_sum` and :meth:`~PerSampleGradients.take_clipped_sums`, then
  :func:`noise_clipped_sum` (``clipped_sums=``) with :func:`node_noise_generator` - clip, sum in float64, noise,
  round and scale into ``p.grad``;
* :class:`SubsampledGaussianAccountant`, :func:`epsilon_for`, :func:`calibrate_noise_multiplier` - accounting;
* :func:`causal_lm_loss`, :func:`seq2seq_loss` - sequence losses averaged within each example (per-example
  gradients that depend on their own example only);
* :class:`PrivacyParameters` - the user's ``max_grad_norm=``, ``noise_multiplier=``/``target_epsilon=`` ... keywords.
"""

from lightning_privdec.privacy.accounting import (
    Accountant,
    ACCOUNTANTS,
    SubsampledGaussianAccountant,
    calibrate_noise_multiplier,
    epsilon_for,
    make_accountant,
)
from lightning_privdec.privacy.config import DEFAULT_DELTA, PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.local_dp import GaussianMechanism, PerSampleClipping, ShardSampler, noise_clipped_sum
from lightning_privdec.privacy.losses import causal_lm_loss, seq2seq_loss
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.privacy.per_sample import (
    GRAD_SAMPLE_MODES,
    GhostClipping,
    PerSampleGradients,
    check_private_model,
)
from lightning_privdec.privacy.pairwise import (
    CorrelatedNoise,
    PairwiseSecrets,
    exchange_public_keys,
    simulate_key_agreement,
    verify_agreement,
)
from lightning_privdec.privacy.sampling import PoissonBatchSampler, node_shard_indices, poisson_dataloader

from lightning_privdec.privacy.accounting.secldp import (
    CalibrationResult,
    calibrate_secldp,
    eps_step_for,
    ldp_sigma,
    secldp_epsilon,
    secldp_epsilon_example_level,
)
from lightning_privdec.privacy.accounting.secldp_step import secldp_step, secldp_step_bound

__all__ = [
    "CalibrationResult",
    "CorrelatedNoise",
    "PairwiseSecrets",
    "calibrate_secldp",
    "eps_step_for",
    "exchange_public_keys",
    "ldp_sigma",
    "secldp_epsilon",
    "secldp_epsilon_example_level",
    "secldp_step",
    "secldp_step_bound",
    "simulate_key_agreement",
    "verify_agreement",
    "ACCOUNTANTS",
    "Accountant",
    "DEFAULT_DELTA",
    "GRAD_SAMPLE_MODES",
    "GhostClipping",
    "GaussianMechanism",
    "PerSampleClipping",
    "ShardSampler",
    "DPStepStats",
    "PerSampleGradients",
    "PoissonBatchSampler",
    "PrivacyConfigError",
    "PrivacyParameters",
    "SubsampledGaussianAccountant",
    "calibrate_noise_multiplier",
    "causal_lm_loss",
    "check_private_model",
    "epsilon_for",
    "make_accountant",
    "noise_clipped_sum",
    "NoiseGenerator",
    "node_noise_generator",
    "node_shard_indices",
    "poisson_dataloader",
    "seq2seq_loss",
]
