"""The small stand-ins Bridge's forward step needs outside a real training run (as upstream's
tests/unit_tests/training/test_gpt_step.py writes them for itself): a no-op timer, and the parts of GlobalState that
gpt_step.forward_step reads. (Bridge's get_batch moves batches with .cuda(): cpu_runtime.CudaAsCpu covers that.)"""


class NoopTimer:
    """Bridge's timers and straggler timer: called, started, stopped and entered, doing nothing."""

    def __call__(self, *args, **kwargs):
        return self

    def start(self, *args, **kwargs):
        return None

    def stop(self, *args, **kwargs):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_state(*, attention_mask_from_dataset: bool = True):
    """The parts of Bridge's GlobalState that gpt_step.forward_step reads."""
    cfg = type("Cfg", (), {})()
    cfg.dataset = type(
        "Dataset",
        (),
        {
            "enable_offline_packing": False,
            "offline_packing_specs": None,
            "skip_getting_attention_mask_from_dataset": not attention_mask_from_dataset,
        },
    )()
    cfg.model = type("Model", (), {"pipeline_model_parallel_layout": None})()
    cfg.rerun_state_machine = type("Rerun", (), {"check_for_nan_in_loss": False, "check_for_spiky_loss": False})()
    state = type("State", (), {})()
    state.cfg = cfg
    state.timers = NoopTimer()
    state.straggler_timer = NoopTimer()
    return state
