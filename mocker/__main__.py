"""``python -m mocker``: a simulated vLLM engine (see mocker/api.py and mocker/engine.py)."""

from __future__ import annotations

import logging
import sys

from mocker.config import parse_args


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from mocker.api import build_app

    app = build_app(cfg)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        timeout_keep_alive=cfg.timeout_keep_alive,
        timeout_graceful_shutdown=2,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
