//! `vps host`: the real host agent. It speaks the host seam (SPEC §3.7) to the server exactly
//! as the emulated hosts do, and runs each instance as a QEMU virtual machine.

pub mod runtime;
