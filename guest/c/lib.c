/* iopath guest: serial output, printf, command line, TSC frequency. */
#include "guest.h"
#include <stdarg.h>

void *memset(void *d, int c, size_t n)
{
    u8 *p = d;
    while (n--)
        *p++ = (u8)c;
    return d;
}

void *memcpy(void *d, const void *s, size_t n)
{
    u8 *p = d;
    const u8 *q = s;
    while (n--)
        *p++ = *q++;
    return d;
}

int memcmp(const void *a, const void *b, size_t n)
{
    const u8 *p = a, *q = b;
    for (; n; n--, p++, q++)
        if (*p != *q)
            return *p - *q;
    return 0;
}

size_t strlen(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

int strncmp(const char *a, const char *b, size_t n)
{
    for (; n; n--, a++, b++) {
        if (*a != *b)
            return (u8)*a - (u8)*b;
        if (!*a)
            return 0;
    }
    return 0;
}

void putc_serial(char c)
{
    outb(SERIAL_PORT, (u8)c);
}

void puts_serial(const char *s)
{
    while (*s)
        putc_serial(*s++);
}

static void put_u64(u64 v, unsigned base, int width, char pad)
{
    char buf[24];
    int n = 0;
    do {
        unsigned d = v % base;
        buf[n++] = (char)(d < 10 ? '0' + d : 'a' + d - 10);
        v /= base;
    } while (v);
    while (n < width && n < 24)
        buf[n++] = pad;
    while (n)
        putc_serial(buf[--n]);
}

/* %d %u %x %s %c %%, with an optional 'l'/'ll' and a zero-padded width. */
void printf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    for (; *fmt; fmt++) {
        if (*fmt != '%') {
            putc_serial(*fmt);
            continue;
        }
        fmt++;
        char pad = ' ';
        int width = 0;
        if (*fmt == '0')
            pad = '0';
        while (*fmt >= '0' && *fmt <= '9')
            width = width * 10 + (*fmt++ - '0');
        int lng = 0;
        while (*fmt == 'l') {
            lng = 1;
            fmt++;
        }
        switch (*fmt) {
        case 'd': {
            s64 v = lng ? va_arg(ap, s64) : va_arg(ap, int);
            if (v < 0) {
                putc_serial('-');
                v = -v;
            }
            put_u64((u64)v, 10, width, pad);
            break;
        }
        case 'u':
            put_u64(lng ? va_arg(ap, u64) : va_arg(ap, unsigned), 10, width, pad);
            break;
        case 'x':
            put_u64(lng ? va_arg(ap, u64) : va_arg(ap, unsigned), 16, width, pad);
            break;
        case 's': {
            const char *s = va_arg(ap, const char *);
            puts_serial(s ? s : "(null)");
            break;
        }
        case 'c':
            putc_serial((char)va_arg(ap, int));
            break;
        case '%':
            putc_serial('%');
            break;
        default:
            putc_serial('?');
            break;
        }
    }
    va_end(ap);
}

void guest_exit(int code)
{
    outb(DEBUG_EXIT_PORT, (u8)code);
    /* Not reached when isa-debug-exit is present. */
    for (;;)
        cpu_relax();
}

/* ---- command line ---- */

#define CMDLINE_MAX 1024
static char cmdline[CMDLINE_MAX];

void cmdline_init(const char *s)
{
    size_t n = 0;
    if (s)
        while (s[n] && n < CMDLINE_MAX - 1) {
            cmdline[n] = s[n];
            n++;
        }
    cmdline[n] = 0;
}

/* Returns a pointer to the value of "key=" (terminated by space or NUL). */
const char *cmdline_get(const char *key)
{
    size_t kl = strlen(key);
    const char *p = cmdline;
    while (*p) {
        while (*p == ' ')
            p++;
        if (!strncmp(p, key, kl) && p[kl] == '=')
            return p + kl + 1;
        while (*p && *p != ' ')
            p++;
    }
    return NULL;
}

u64 cmdline_u64(const char *key, u64 dflt)
{
    const char *v = cmdline_get(key);
    if (!v || *v < '0' || *v > '9')
        return dflt;
    u64 r = 0;
    while (*v >= '0' && *v <= '9')
        r = r * 10 + (u64)(*v++ - '0');
    return r;
}

/* "only=a,b" selects rows by name prefix; absent means every row. */
int cmdline_has_word(const char *list_key, const char *word)
{
    const char *v = cmdline_get(list_key);
    if (!v)
        return 1;
    while (*v && *v != ' ') {
        const char *e = v;
        while (*e && *e != ' ' && *e != ',')
            e++;
        size_t n = (size_t)(e - v);
        if (n && !strncmp(word, v, n))
            return 1;
        v = *e == ',' ? e + 1 : e;
    }
    return 0;
}

/* ---- TSC ---- */

u64 tsc_khz;
const char *tsc_source = "none";

/* PIT channel 2, mode 0, gated through port 0x61: the classic calibration. */
static u64 tsc_calibrate_pit(void)
{
    const u32 ms = 50;
    const u32 latch = 1193182u * ms / 1000u;
    u8 p61 = inb(0x61);
    outb(0x61, (u8)((p61 & ~0x02) | 0x01));
    outb(0x43, 0xb0);
    outb(0x42, (u8)(latch & 0xff));
    outb(0x42, (u8)(latch >> 8));
    u64 t0 = rdtsc();
    u64 spins = 0;
    while (!(inb(0x61) & 0x20)) {
        if (++spins > 100000000ull)
            return 0;
    }
    u64 t1 = rdtsc();
    outb(0x61, p61);
    return (t1 - t0) / ms;
}

void tsc_init(void)
{
    u32 a, b, c, d, max;
    tsc_khz = cmdline_u64("tsc_khz", 0);
    if (tsc_khz) {
        tsc_source = "cmdline";
        return;
    }
    cpuid(0, 0, &max, &b, &c, &d);
    if (max >= 0x15) {
        cpuid(0x15, 0, &a, &b, &c, &d);
        if (a && b && c) {
            tsc_khz = (u64)c * b / a / 1000;
            tsc_source = "cpuid15";
            return;
        }
    }
    if (max >= 0x16) {
        cpuid(0x16, 0, &a, &b, &c, &d);
        if (a) {
            tsc_khz = (u64)a * 1000;
            tsc_source = "cpuid16";
            return;
        }
    }
    cpuid(0x40000000, 0, &a, &b, &c, &d);
    if (a >= 0x40000010 && a < 0x40000100) {
        cpuid(0x40000010, 0, &a, &b, &c, &d);
        if (a) {
            tsc_khz = a;
            tsc_source = "cpuid40000010";
            return;
        }
    }
    tsc_khz = tsc_calibrate_pit();
    tsc_source = tsc_khz ? "pit" : "none";
}

u64 cycles_to_ns(u64 cycles)
{
    if (!tsc_khz)
        return 0;
    return cycles * 1000000ull / tsc_khz;
}
