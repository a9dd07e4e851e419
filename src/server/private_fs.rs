//! Files and directories under `STATE_DIR` (API keys, the usage journal, used op-token
//! nonces) hold what only the relay should read: hashed keys, who used what, when. They
//! are created owner-only (files 0600, directories 0700) on Unix rather than with the
//! process umask, which commonly leaves them world-readable.

use std::fs::{self, OpenOptions};
use std::io;
use std::path::Path;

/// Creates `dir` and any missing parents, owner-only. An existing directory keeps its mode
/// (the operator may have chosen one).
pub fn create_dir(dir: &Path) -> io::Result<()> {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Open options that create a file owner-only (`create` is set; the caller adds the
/// rest: append, write, truncate).
pub fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.create(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options
}

/// Replaces `dir/name` with `body` atomically and owner-only: a temporary file, fsync,
/// rename over the old one, fsync the directory. A crash leaves the old file or the new
/// one, never half of either. The error says which step failed.
pub fn replace(dir: &Path, name: &str, body: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let fail = |what: &str, e: io::Error| format!("{what}: {e}");
    create_dir(dir).map_err(|e| fail("create state dir", e))?;
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let mut file = options()
        .write(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| fail("open temp file", e))?;
    file.write_all(body).map_err(|e| fail("write", e))?;
    file.sync_all().map_err(|e| fail("fsync", e))?;
    drop(file);
    fs::rename(&tmp, dir.join(name)).map_err(|e| fail("rename", e))?;
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// Mode bits of `path` (the permission part).
    pub fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn files_and_dirs_are_owner_only_whatever_the_umask() {
        let root = std::env::temp_dir().join(format!("mr-private-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dir = root.join("a/b");
        create_dir(&dir).unwrap();
        assert_eq!(mode(&root.join("a")), 0o700);
        assert_eq!(mode(&dir), 0o700);
        let file = dir.join("f");
        options().append(true).open(&file).unwrap();
        assert_eq!(mode(&file), 0o600);
        fs::remove_dir_all(&root).unwrap();
    }
}
