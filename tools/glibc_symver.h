/* Included first in every file of the wheels' build (tools/build_wheel.sh, `-include`).
 *
 * zig's compiler_rt, linked statically for its half-float and CPU-feature helpers, also
 * defines memcpy, memmove and memset; an unversioned reference then binds to those, which are
 * about 10% slower than glibc's on the shared-memory copies.  A versioned reference can only
 * bind to glibc's own symbol, so these make every reference glibc's. */
#if defined(__x86_64__)
__asm__(".symver memcpy, memcpy@GLIBC_2.14");
__asm__(".symver memmove, memmove@GLIBC_2.2.5");
__asm__(".symver memset, memset@GLIBC_2.2.5");
#elif defined(__aarch64__)
__asm__(".symver memcpy, memcpy@GLIBC_2.17");
__asm__(".symver memmove, memmove@GLIBC_2.17");
__asm__(".symver memset, memset@GLIBC_2.17");
#endif
