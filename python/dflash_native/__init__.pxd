# cython: language_level=3
# `from dflash_native cimport dfn_engine_create, dfn_generate, ...`: the C API's declarations
# (dflash_native/dflash_native.pxd, which `from dflash_native cimport dflash_native` also reaches).
from dflash_native.dflash_native cimport *
