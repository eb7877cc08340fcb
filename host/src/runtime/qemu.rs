//! The `qemu` runtime: one QEMU process per guest, driven over QMP.
