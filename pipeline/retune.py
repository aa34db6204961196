"""`python -m pipeline.retune`: the closed loop's re-tune step alone; the step lives in `pipeline.loop.retune`."""

from pipeline.loop.retune import main

if __name__ == "__main__":
    raise SystemExit(main())
