//! What the bundle reads from ELF files: the interpreter and `DT_NEEDED` libraries of a
//! dynamically linked program (what `ldd` would list, without running anything), and the
//! `.modinfo` of a kernel module.

use object::elf;
use object::read::elf::{ElfFile64, ProgramHeader as _};
use object::{Endianness, Object as _, ObjectSection as _};

use crate::Error;

/// A dynamically linked program's or library's needs.
#[derive(Debug, Default)]
pub struct Needs {
    /// The program interpreter (`/lib64/ld-linux-x86-64.so.2`), for a program.
    pub interpreter: Option<String>,
    /// The sonames of `DT_NEEDED`, in order.
    pub libraries: Vec<String>,
}

/// Reads what `data`, an x86-64 ELF file named `what`, needs to run.
pub fn needs(what: &str, data: &[u8]) -> Result<Needs, Error> {
    let bad =
        |err: object::Error| Error::Packages(format!("{what} is not a usable ELF file: {err}"));
    let file = ElfFile64::<Endianness>::parse(data).map_err(bad)?;
    let endian = file.endian();
    let mut needs = Needs::default();
    for header in file.elf_program_headers() {
        if let Some(interp) = header.interpreter(endian, data).map_err(bad)? {
            needs.interpreter = Some(String::from_utf8_lossy(interp).into_owned());
        }
    }
    let dynamic = file.elf_dynamic_table().map_err(bad)?;
    for entry in dynamic.iter() {
        if entry.tag == elf::DT_NEEDED {
            let name = dynamic.string(entry).map_err(bad)?;
            needs
                .libraries
                .push(String::from_utf8_lossy(name).into_owned());
        }
    }
    Ok(needs)
}

/// The `key=value` pairs of a kernel module's `.modinfo` section.
pub fn modinfo(what: &str, data: &[u8]) -> Result<Vec<(String, String)>, Error> {
    let bad = |err: String| Error::Packages(format!("{what} is not a kernel module: {err}"));
    let file = ElfFile64::<Endianness>::parse(data).map_err(|e| bad(e.to_string()))?;
    let section = file
        .section_by_name(".modinfo")
        .ok_or_else(|| bad("it has no .modinfo section".into()))?;
    let info = section.data().map_err(|e| bad(e.to_string()))?;
    Ok(info
        .split(|&b| b == 0)
        .filter_map(|entry| {
            let entry = String::from_utf8_lossy(entry);
            let (key, value) = entry.split_once('=')?;
            Some((key.to_string(), value.to_string()))
        })
        .collect())
}
