"""``megaformer-lm-eval``: lm-evaluation-harness's own command line, with plugin models registered.

    megaformer-lm-eval --model megaformer --model_args checkpoint=RUN/checkpoints \\
        --tasks hellaswag --device cpu [every other lm_eval option]

megaformer declares its lm_eval model in pyproject.toml as an entry point of the group
``lm_eval.models`` (``megaformer = "megaformer.tools.zero_shot:MegaformerLM"``), the plugin group
that lm_eval releases with entry-point plugins read themselves (upstream PR #4013), so that there
``lm_eval --model megaformer`` works once megaformer is installed. lm_eval 0.4.13, the version this
project is tested with, reads no entry points: its ``--model`` knows only the models in its own
source tree. This command registers every installed ``lm_eval.models`` entry point (megaformer's and
any other package's; lazily, as placeholders imported when used, never replacing lm_eval's own
models) and then runs lm_eval's command line unchanged (``lm_eval.__main__.cli_evaluate``), so it
takes and prints exactly what ``lm_eval`` does. ``python -m megaformer.tools.lm_eval_cli`` is the same.
"""

from __future__ import annotations

import importlib.metadata as md

GROUP = "lm_eval.models"


def register_entry_point_models() -> list[str]:
    """Register each installed ``lm_eval.models`` entry point in lm_eval's model registry.

    lm_eval's own models are registered first (its ``get_model`` loads them only into an empty
    registry), and a name lm_eval already has is left to lm_eval.

    Returns:
        The names registered here.
    """
    import lm_eval.models  # noqa: F401 - registers lm_eval's own models (lazily)
    from lm_eval.api.registry import model_registry

    added = []
    for ep in md.entry_points(group=GROUP):
        if ep.name not in model_registry:
            model_registry.register(ep.name, target=ep)
            added.append(ep.name)
    return added


def main() -> None:
    """lm_eval's command line (``sys.argv``) after :func:`register_entry_point_models`."""
    register_entry_point_models()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
