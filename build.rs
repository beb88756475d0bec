//! Generates the C header from src/ffi with cbindgen and gives the shared library its soname.
//!
//! The header is always written to `$OUT_DIR/dsv4.h`; with `DSV4_UPDATE_HEADER=1` (`make
//! header`) it is also written to include/dsv4.h, which is committed. A test compares the two so
//! a change to src/ffi without `make header` fails the build's tests.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DSV4_UPDATE_HEADER");

    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("set by cargo"));
    let version = env::var("CARGO_PKG_VERSION").expect("set by cargo");
    let major = env::var("CARGO_PKG_VERSION_MAJOR").expect("set by cargo");
    let minor = env::var("CARGO_PKG_VERSION_MINOR").expect("set by cargo");
    let patch = env::var("CARGO_PKG_VERSION_PATCH").expect("set by cargo");

    let mut config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("cbindgen.toml is readable and valid");
    config.after_includes = Some(format!(
        "\n/* The version of this header; compare with dsv4_version() at run time. */\n\
         #define DSV4_VERSION_MAJOR {major}\n\
         #define DSV4_VERSION_MINOR {minor}\n\
         #define DSV4_VERSION_PATCH {patch}\n\
         #define DSV4_VERSION_STRING \"{version}\"\n"
    ));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen can generate the header from src/ffi");
    bindings.write_to_file(out_dir.join("dsv4.h"));
    if env::var("DSV4_UPDATE_HEADER").as_deref() == Ok("1") {
        bindings.write_to_file(crate_dir.join("include/dsv4.h"));
    }

    // Rust gives cdylibs no soname; ours follows the ABI's major version.
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libdsv4.so.{major}");
    }
}
