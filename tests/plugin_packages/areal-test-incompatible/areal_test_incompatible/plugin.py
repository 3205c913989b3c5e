raise RuntimeError("this module must never be imported: the kernel version check should skip it")
