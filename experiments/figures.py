"""Where `./run effect` keeps its figures, and how they are cited: JSON only, no torch.

`pr` (the tool imports no experiment) reads figures.json itself and cites its ``citations`` lines as they are.

The figures of a run belong to the patch that was measured: they live in ``.work/effect/<key>/figures.json`` (the
default short run) and ``.work/effect/<key>/plateau/figures.json`` (``--plateau``), key = pr's ``patch_key`` (the git
blob hash of the patch's diff; its message does not count), as pr keys its own results. A figure is cited only with
its setting, the run's size and its seeds (``cite``, ``summary_line``).

figures.json (every number measured in the run):

    key, size ("short" | "plateau" | "small"), wall_seconds
    citations             summary (summary_line: every setting, one line) and <setting>.<metric> (cite) for metric
                          teacher-forced and speculative: ready to paste, each naming its setting, size and seeds
    plan                  pretrain_steps, sft_steps, seeds, settings, eval_every, eval_steps, eval_batches, batch,
                          pretrain_batch, pretrain_seq, pretrain_lr, sft_lr, new_tokens
    model                 spec, parameters, mtp_num_layers, mtp_loss_scaling_factor
    arms.<arm>            arm = "unpatched" (the release as shipped) | "patched" (the tree under test): tree,
                          gpt_step_file, pretrained_weights_sha256 (one per seed), sft_data_sha256 (one per run),
                          import_seconds, pretrain_seconds, fine_tune_seconds, peak_rss_mib
    same_pretrained_weights, same_data   the arms started from equal weights and saw equal batches (hashes)
    pretrain              per seed: lm_loss_first, lm_loss_last, held-out lm_top1 and mtp_top1 (every position)
    settings.<setting>    setting = "same-language" | "distinct-answers" | "padding-only"
      description, conclusion (one line, from the intervals below)
      step_one            SFT step 1, same weights and batch in both arms: mix (share of the MTP depth-1 targets that
                          are prompt / answer / padding), mtp_ce_by_role.<role>.<arm>, and <figure>.<arm> for
                          mtp_1_loss (logged), grad_norm, lm_loss, mtp_loss_mass_on_masked, logged_acceptance;
                          each a spread {mean, sd, n, values (one per seed; null where nothing was counted)}
      metrics.<metric>    metric = one of METRICS; label;
        steps             the evaluation steps; <arm>: per step, one value per seed
        final             at the last step: <arm> spread, paired_diff {mean, sd, values, n, ci95 [low, high]}
                          (patched - unpatched per seed; t-interval of the paired differences)
        to_threshold      threshold_fraction; thresholds (one per seed: that fraction of the better arm's final
                          value); <arm>: per seed, the evaluation step from which the metric stays at or above
                          it (null: not reached);
                          paired_diff over the seeds where both arms reached it (null if fewer than 2)
"""

import json
from pathlib import Path

from maintain.repo import WORK


ARMS = ("unpatched", "patched")
SETTINGS = ("same-language", "distinct-answers", "padding-only")
METRICS = {  # id: what it is (every one over the same held-out batches, at the same steps, in both arms)
    "teacher-forced": "MTP depth-1 top-1 on the loss positions (teacher-forced)",
    "speculative": "speculative acceptance of the k=1 MTP draft against the LM head's greedy token",
    "tokens-per-step": "accepted tokens per verify step (greedy decoding of the answer, k=1 MTP draft)",
    "logged": "mtp_1_acceptance_rate as core logs it, on the same batches",
    "teacher-forced-answers": "MTP depth-1 top-1 on answer targets (teacher-forced)",
    "mtp-ce": "MTP depth-1 CE on the loss positions",
    "lm-top1": "LM top-1 on the loss positions",
}


def patch_key() -> str:
    """The measured patch's key, as pr keys its own results: the git blob hash of the patch's diff."""
    from maintain import pr
    from mtp_mask_fix.patch import Patch

    return pr.patch_key(Patch.load())


def effect_dir(size: str = "short", key: str | None = None) -> Path:
    """Where a run of this size keeps figures.json and effect.png."""
    base = WORK / "effect" / (key or patch_key())
    return base if size == "short" else base / size


def load(size: str = "short") -> dict | None:
    """The figures of the last run of this size for the current patch, or None if it has not run."""
    path = effect_dir(size) / "figures.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_label(figures: dict) -> str:
    """Size and seeds of a run, and the model: what every cited figure carries."""
    plan, seeds = figures["plan"], figures["plan"]["seeds"]
    return (
        f"size {figures['size']} ({plan['sft_steps']} SFT steps), seeds {seeds[0]}-{seeds[-1]} (n={len(seeds)}), "
        f"tiny model ({figures['model']['parameters']} parameters)"
    )


def interval(diff: dict) -> str:
    """A paired difference as mean [95 % interval] (one seed: no interval)."""
    if diff["mean"] is None:
        return "no value"
    if diff["ci95"] is None:
        return f"{diff['mean']:+.3f} (one seed, no interval)"
    low, high = diff["ci95"]
    return f"{diff['mean']:+.3f} [{low:+.3f}, {high:+.3f}]"


def _mean(spread: dict) -> str:
    return "no value" if spread["mean"] is None else f"{spread['mean']:.3f} (n={spread['n']})"


def cite(figures: dict, setting: str, metric: str = "teacher-forced") -> str:
    """One final figure with its setting, size and seeds: both arms' means and the paired 95 % interval."""
    final = figures["settings"][setting]["metrics"][metric]["final"]
    return (
        f"{setting} setting, {METRICS[metric]}: unpatched {_mean(final['unpatched'])}, patched "
        f"{_mean(final['patched'])}, paired difference {interval(final['paired_diff'])} (95 % t-interval over "
        f"seeds; {run_label(figures)})"
    )


def summary_line(figures: dict) -> str:
    """One line for a PR text: per setting, teacher-forced and speculative acceptance, patched - unpatched."""
    parts = []
    for setting, data in figures["settings"].items():
        metrics = data["metrics"]
        parts.append(
            f"{setting}: teacher-forced {interval(metrics['teacher-forced']['final']['paired_diff'])}, "
            f"speculative {interval(metrics['speculative']['final']['paired_diff'])}"
        )
    return (
        f"MTP acceptance after SFT, patched - unpatched with paired 95 % intervals ({run_label(figures)}): "
        + "; ".join(parts)
    )
