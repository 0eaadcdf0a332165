"""``python -m kvpubd`` and the ``kvpubd`` command. Ctrl-C while the command line is still
being imported exits 130 like Ctrl-C anywhere else, without a traceback."""

import sys


def main() -> None:
    try:
        from kvpubd.cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("\nkvpubd: interrupted\n")
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
