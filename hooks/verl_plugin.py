"""Belayer's `verl.plugins` entry point: imports the verl hook (`belayer_plugin.hooks.verl`) and makes a failure
to import it visible.

verl 0.9.1 imports every entry point of its `verl.plugins` group at `import verl` and logs a failure at debug
level only (verl/__init__.py), so a broken install would surface later as OmegaConf's "Unsupported interpolation
type belayer_recipe" or an unknown class name. Here the failure is logged as an error and printed, and
`${belayer_recipe:...}` is registered to raise it with its cause: the recipe's first Belayer line names it.
This module must stay light: it runs in every verl process.

Owns: importing the verl hook at `import verl` and making its failure visible. Must not: import anything heavy
itself (it runs in every verl process).
"""

from __future__ import annotations

import logging
import sys

try:
    import belayer_plugin.hooks.verl  # noqa: F401  (registers Belayer's parts with verl)
except Exception as _error:  # verl swallows it (see the module doc): say it before re-raising
    _MESSAGE = (f"Belayer's verl hook failed to import at `import verl`: {type(_error).__name__}: {_error}. "
                "Belayer is not registered with verl (no ${belayer_recipe:...}, agent loop managers, balancer)")
    logging.getLogger("belayer.hooks.verl").error(_MESSAGE)
    print(f"[belayer] {_MESSAGE}", file=sys.stderr, flush=True)

    def _failed(*_args: object) -> str:
        raise RuntimeError(_MESSAGE)

    try:
        from omegaconf import OmegaConf

        OmegaConf.register_new_resolver("belayer_recipe", _failed, replace=True)
    except Exception:  # noqa: BLE001 - without OmegaConf no recipe can name the resolver anyway
        pass
    raise
