"""GPU tier stand-in for vllm.logger: init_logger is a plain logging logger
(tests/without_vllm/README.md)."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
