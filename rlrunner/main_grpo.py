"""Entry point: `python -m rlrunner.main_grpo [--config-name NAME] [--config-path DIR] [--cfg] [key=value ...]`.

Config -> input checks -> experiment lock and resume checkpoint -> Ray -> training. User errors end
the process with one line on stderr and the exit code of their kind (`rlrunner.errors.EXIT_CODES`,
which `--help` prints).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from rlrunner.config import DEFAULT_CONFIG_NAME, config_to_yaml, load_config
from rlrunner.errors import ClusterLostError, ConfigError, exit_codes_text, user_error

logger = logging.getLogger("rlrunner")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rlrunner.main_grpo",
        description="GRPO training on Ray worker groups. Hydra overrides follow the options, e.g. runner.max_steps=20.",
        epilog=exit_codes_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config-name", "-cn", default=DEFAULT_CONFIG_NAME, help="a YAML in the config folder, without .yaml"
    )
    parser.add_argument(
        "--config-path", "-cp", default=None, help="the config folder (default: the repository's configs/)"
    )
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, +key=value, ~key")
    return parser.parse_args(argv)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("ray", "transformers", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*set_vital.*")


def check_inputs(cfg) -> None:
    """Fail before any worker starts on inputs that cannot work (each check raises a one-line ConfigError)."""
    from rlrunner.backends.registry import check_model_path
    from rlrunner.rewards.scorer import check_reward_function
    from rlrunner.runner.context import reward_settings
    from rlrunner.trackers.registry import check_backends
    from rlrunner.utils.user_code import CodeLoadError

    if cfg.model.path is not None:
        check_model_path(cfg.model.path)
    check_backends(list(cfg.runner.logger.backends))
    if cfg.reward.function is not None:
        try:
            check_reward_function(reward_settings(cfg))
        except CodeLoadError as exc:
            raise ConfigError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    try:
        cfg = load_config(args.overrides, config_name=args.config_name, config_dir=args.config_path)
        if args.cfg:
            print(config_to_yaml(cfg), end="")
            return 0
        check_inputs(cfg)
        from rlrunner.cluster.ray_setup import init_ray
        from rlrunner.runner.stopping import StopRequest
        from rlrunner.runner.supervisor import Supervisor

        stop = StopRequest(cfg.runner.max_wall_time_s)
        supervisor = Supervisor(cfg, stop)

        def connect() -> None:
            init_ray(cfg.cluster.ray_address, cfg.cluster.num_cpus)
            stop.install()  # after ray.init, which installs a SIGTERM handler of its own

        supervisor.run(connect)
        return 0
    except KeyboardInterrupt:
        print("rlrunner: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        error = user_error(exc)
        if error is None:
            raise
        print(f"rlrunner: {error.label}: {error}", file=sys.stderr)
        if isinstance(error, ClusterLostError):
            # Ray's exit hooks would block on the GCS that is gone: leave now, the launch script relaunches.
            sys.stderr.flush()
            os._exit(error.exit_code)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
