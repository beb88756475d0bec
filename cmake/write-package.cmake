# Writes dsv4Config.cmake, dsv4ConfigVersion.cmake and dsv4.pc into an install prefix.
# Run by `make install`:  cmake -DPREFIX=... -DDSV4_VERSION=... -DNATIVE_LIBS=... -P this-file
cmake_minimum_required(VERSION 3.16)
include(CMakePackageConfigHelpers)

string(REGEX MATCH "^[0-9]+" DSV4_MAJOR "${DSV4_VERSION}")
# "-lhwloc -lm" → "hwloc;m" for INTERFACE_LINK_LIBRARIES; kept as flags for pkg-config.
separate_arguments(_flags UNIX_COMMAND "${NATIVE_LIBS}")
set(DSV4_NATIVE_STATIC_LIBS "")
foreach(_flag IN LISTS _flags)
  string(REGEX REPLACE "^-l" "" _lib "${_flag}")
  list(APPEND DSV4_NATIVE_STATIC_LIBS "${_lib}")
endforeach()
set(DSV4_NATIVE_STATIC_LIBS_FLAGS "${NATIVE_LIBS}")

set(_here "${CMAKE_CURRENT_LIST_DIR}")
configure_file("${_here}/dsv4Config.cmake.in" "${PREFIX}/lib/cmake/dsv4/dsv4Config.cmake" @ONLY)
write_basic_package_version_file("${PREFIX}/lib/cmake/dsv4/dsv4ConfigVersion.cmake"
  VERSION "${DSV4_VERSION}" COMPATIBILITY SameMajorVersion)
configure_file("${_here}/dsv4.pc.in" "${PREFIX}/lib/pkgconfig/dsv4.pc" @ONLY)
