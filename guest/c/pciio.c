/*
 * iopath guest: workload "pci": register reads and writes of one PCI function's BARs, as a
 * driver makes them, for tests against devices iopath did not write (libvfio-user's samples).
 *
 *   workload=pci id=VVVV:DDDD ops=OP,OP,...
 *
 * OP is rW:B:OFF (read W bytes of BAR B at OFF) or wW:B:OFF:VAL (write VAL), numbers in hex
 * but W (1, 2, 4, or 8 on a memory BAR). Each prints
 *   @pciio op=r bar=B off=0xOFF width=W value=0xVAL
 * and one outside its BAR, or malformed, prints status=refused and is not made.
 */
#include "guest.h"

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A hex number at *p (at least one digit, at most 16), *p moved past it. */
static int parse_hex(const char **p, u64 *out)
{
    u64 v = 0;
    int n = 0, d;
    while ((d = hex_digit(**p)) >= 0 && n < 16) {
        v = v << 4 | (u64)d;
        (*p)++;
        n++;
    }
    *out = v;
    return n > 0 && hex_digit(**p) < 0;
}

static u64 bar_access(const struct pci_bar *b, int write, u64 off, u64 width, u64 v)
{
    u64 a = b->addr + off;
    if (b->io) {
        u16 port = (u16)a;
        if (write) {
            if (width == 1)
                outb(port, (u8)v);
            else if (width == 2)
                outw(port, (u16)v);
            else
                outl(port, (u32)v);
            return v;
        }
        return width == 1 ? inb(port) : width == 2 ? inw(port) : inl(port);
    }
    if (write) {
        if (width == 1)
            mmio_write8(a, (u8)v);
        else if (width == 2)
            mmio_write16(a, (u16)v);
        else if (width == 4)
            mmio_write32(a, (u32)v);
        else
            mmio_write64(a, v);
        return v;
    }
    return width == 1 ? mmio_read8(a) : width == 2 ? mmio_read16(a) : width == 4 ? mmio_read32(a) : mmio_read64(a);
}

/* One OP at *p; returns 0 if it was malformed or refused. */
static int one_op(const struct pci_dev *d, const char **p)
{
    char op = **p;
    u64 width = 0, bar = 0, off = 0, v = 0;
    int ok = (op == 'r' || op == 'w');
    if (ok) {
        (*p)++;
        ok = parse_hex(p, &width) && **p == ':';
    }
    if (ok) {
        (*p)++;
        ok = parse_hex(p, &bar) && **p == ':';
    }
    if (ok) {
        (*p)++;
        ok = parse_hex(p, &off);
    }
    if (ok && op == 'w') {
        ok = **p == ':';
        if (ok) {
            (*p)++;
            ok = parse_hex(p, &v);
        }
    }
    const struct pci_bar *b = ok && bar < 6 ? &d->bar[bar] : NULL;
    ok = b && b->size && b->addr && (width == 1 || width == 2 || width == 4 || (width == 8 && !b->io)) &&
         off < b->size && width <= b->size - off && (off & (width - 1)) == 0;
    if (!ok) {
        printf("@pciio op=%c bar=%lu off=0x%lx width=%lu status=refused\n", op, bar, off, width);
        return 0;
    }
    v = bar_access(b, op == 'w', off, width, v);
    printf("@pciio op=%c bar=%lu off=0x%lx width=%lu value=0x%lx\n", op, bar, off, width, v);
    return 1;
}

int workload_pci(void)
{
    const char *id = cmdline_get("id");
    u64 vendor = 0, device = 0;
    const char *p = id;
    if (!id || !parse_hex(&p, &vendor) || *p != ':' || (p++, !parse_hex(&p, &device))) {
        printf("@error workload=pci needs id=VVVV:DDDD\n");
        return EXIT_FAIL;
    }
    struct pci_dev *d = pci_find((u16)vendor, (u16)device);
    if (!d) {
        printf("@error no PCI function %04lx:%04lx\n", vendor, device);
        return EXIT_FAIL;
    }
    const char *ops = cmdline_get("ops");
    int rc = EXIT_OK;
    while (ops && *ops && *ops != ' ') {
        if (!one_op(d, &ops))
            rc = EXIT_FAIL;
        while (*ops && *ops != ',' && *ops != ' ')
            ops++;
        if (*ops == ',')
            ops++;
    }
    return rc;
}
