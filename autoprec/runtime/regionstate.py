"""Whether the running thread is inside an fp32 region of an applied policy: one flag shared by the
regions that set it (:mod:`autoprec.runtime.apply`) and the modules that must step out of it for their own
compute dtype (:mod:`autoprec.runtime.torchao_linear`)."""

from __future__ import annotations

import threading

__all__ = ["in_fp32_region"]

in_fp32_region = threading.local()  # .value: True inside an fp32 region (unset: False)
