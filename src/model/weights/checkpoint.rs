//! A checkpoint on disk: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`, memory-mapped and indexed by tensor name.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::io::Read;

use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;

use crate::error::{Error, Result};

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Offset of the first tensor byte (after the 8-byte length and the JSON header).
    data_start: usize,
}

/// One stored tensor: dtype, shape and raw little-endian bytes.
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// Every tensor of a checkpoint, memory-mapped.
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, (usize, TensorInfo)>,
}

impl Checkpoint {
    /// Opens the safetensors files of a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = open_regular(path)?;
            // SAFETY: the file is opened read-only and mapped read-only; dsv4 never writes it.
            // A process that truncates the file while it is mapped would fault, as with any
            // reader of a memory-mapped checkpoint; the docs ask not to modify checkpoints in
            // use.
            let map = unsafe { Mmap::map(&file) }
                .map_err(|e| Error::io(format!("cannot map {}: {e}", path.display())))?;
            let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
                Error::model_format(format!(
                    "{} is not a valid safetensors file ({e}): it may be truncated or corrupt; \
                     download it again",
                    path.display()
                ))
            })?;
            for (name, info) in metadata.tensors() {
                if let Some((other, _)) = tensors
                    .get(&name)
                    .map(|(i, info): &(usize, TensorInfo)| (*i, info))
                {
                    return Err(Error::model_format(format!(
                        "tensor `{name}` is stored twice ({} and {})",
                        files[other].display(),
                        path.display()
                    )));
                }
                tensors.insert(name, (i, info.clone()));
            }
            shards.push(Shard {
                path: path.clone(),
                map,
                data_start: 8 + header_len,
            });
        }
        Ok(Self { shards, tensors })
    }

    pub fn get(&self, name: &str) -> Option<RawTensor<'_>> {
        let (key, (shard, info)) = self.tensors.get_key_value(name)?;
        let shard = &self.shards[*shard];
        let (start, end) = info.data_offsets;
        Some(RawTensor {
            name: key,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: &shard.map[shard.data_start + start..shard.data_start + end],
        })
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }
}

/// The safetensors files to open: the index's shards, `model.safetensors`, or every
/// `*.safetensors` file of the directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = if dir.is_file() {
        dir.parent().unwrap_or(Path::new("."))
    } else {
        dir
    };
    let index = dir.join("model.safetensors.index.json");
    if present(&index)? {
        let mut text = String::new();
        open_regular(&index)?
            .read_to_string(&mut text)
            .map_err(|e| Error::io(format!("cannot read {}: {e}", index.display())))?;
        // Strict: a tensor listed twice must not silently map to whichever shard came last.
        let value: Value = crate::config::json::parse_strict(&text)
            .map_err(|e| Error::model_format(format!("{}: {e}", index.display())))?;
        let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
            return Err(Error::model_format(format!(
                "{} has no `weight_map` object",
                index.display()
            )));
        };
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for path in &paths {
            if !present(path)? {
                return Err(Error::io(format!(
                    "{} lists {} but it is missing: the download is incomplete",
                    index.display(),
                    path.display()
                )));
            }
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if present(&single)? {
        return Ok(vec![single]);
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("cannot list {}: {e}", dir.display())))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    all.sort();
    for path in &all {
        // Refused here rather than skipped: a stray FIFO or directory named like a shard means
        // the directory is not what the operator thinks it is.
        present(path)?;
    }
    if all.is_empty() {
        return Err(Error::io(format!(
            "{} has no weights (no model.safetensors, no model.safetensors.index.json, no \
             *.safetensors): point model_path at a DeepSeek V4 checkpoint directory",
            dir.display()
        )));
    }
    Ok(all)
}

/// Whether `path` exists as a regular file once symlinks are followed (Hugging Face snapshots
/// link every file into a blob store). `Ok(false)` when nothing is there; an error when
/// something else is (a FIFO would block the open forever, a device or directory is not a
/// checkpoint).
fn present(path: &Path) -> Result<bool> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() => Ok(true),
        Ok(meta) => Err(not_regular(path, meta.file_type())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                Err(Error::io(format!(
                    "{} is a symbolic link to a file that does not exist: the download is \
                     incomplete; download the checkpoint again",
                    path.display()
                )))
            } else {
                Ok(false)
            }
        }
        // Permissions, a symbolic link loop, an I/O error: the OS's words say which.
        Err(e) => Err(Error::io(format!(
            "cannot inspect {}: {e}: make it a readable file (or a link to one)",
            path.display()
        ))),
    }
}

/// Opens a checkpoint file read-only, refusing anything but a regular file. The open does not
/// block (`O_NONBLOCK`) and the type is checked on the open descriptor, so a file replaced by
/// a FIFO between a check and the open is still refused rather than waited on forever.
fn open_regular(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(format!("cannot open {}: {e}", path.display())))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("cannot inspect {}: {e}", path.display())))?;
    if meta.is_file() {
        Ok(file)
    } else {
        Err(not_regular(path, meta.file_type()))
    }
}

fn not_regular(path: &Path, kind: std::fs::FileType) -> Error {
    let what = if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Error::model_format(format!(
        "{} is {what}, not a regular file: dsv4 reads checkpoint files only from regular files \
         (or symbolic links to them); remove it from the checkpoint directory or point \
         model_path at a directory holding only the checkpoint's files",
        path.display()
    ))
}
