/*
 * iopath guest: PCI enumeration over the type-1 configuration mechanism
 * (ports 0xCF8/0xCFC), BAR sizing, and BAR assignment where no firmware did it.
 */
#include "guest.h"

#define PCI_CONFIG_ADDR 0xcf8
#define PCI_CONFIG_DATA 0xcfc

#define PCI_COMMAND 0x04
#define PCI_COMMAND_IO 0x1
#define PCI_COMMAND_MEMORY 0x2
#define PCI_COMMAND_MASTER 0x4
#define PCI_HEADER_TYPE 0x0e
#define PCI_BAR0 0x10

/* Windows used when a BAR is unassigned (no firmware ran). */
#define MMIO32_WINDOW_BASE 0xe0000000ull
#define MMIO32_WINDOW_END 0xfec00000ull
#define IO_WINDOW_BASE 0xc000
#define IO_WINDOW_END 0x10000

struct pci_dev pci_devs[PCI_MAX_DEVS];
int pci_ndevs;

static u64 mmio_next = MMIO32_WINDOW_BASE;
static u64 io_next = IO_WINDOW_BASE;

static u32 cfg_addr(u8 bus, u8 dev, u8 fn, u8 off)
{
    return 0x80000000u | ((u32)bus << 16) | ((u32)dev << 11) | ((u32)fn << 8) | (off & 0xfc);
}

static u32 cfg_read(u8 bus, u8 dev, u8 fn, u8 off)
{
    outl(PCI_CONFIG_ADDR, cfg_addr(bus, dev, fn, off));
    return inl(PCI_CONFIG_DATA);
}

static void cfg_write(u8 bus, u8 dev, u8 fn, u8 off, u32 v)
{
    outl(PCI_CONFIG_ADDR, cfg_addr(bus, dev, fn, off));
    outl(PCI_CONFIG_DATA, v);
}

u32 pci_cfg_read32(const struct pci_dev *d, u8 off) { return cfg_read(d->bus, d->dev, d->fn, off); }
void pci_cfg_write32(const struct pci_dev *d, u8 off, u32 v) { cfg_write(d->bus, d->dev, d->fn, off, v); }

/* A 16-bit write at `off` (even): only those two bytes change. A capability's
 * ID and next pointer must not be written (libvfio-user refuses any write that
 * touches them), so a control register goes alone. */
void pci_cfg_write16(const struct pci_dev *d, u8 off, u16 v)
{
    outl(PCI_CONFIG_ADDR, cfg_addr(d->bus, d->dev, d->fn, off));
    outw((u16)(PCI_CONFIG_DATA + (off & 2)), v);
}

static u64 align_up(u64 v, u64 a) { return (v + a - 1) & ~(a - 1); }

/* Sizes every BAR (decoding off meanwhile) and assigns the unassigned ones. */
static void size_bars(struct pci_dev *d)
{
    u32 cmd = pci_cfg_read32(d, PCI_COMMAND) & 0xffff;
    pci_cfg_write32(d, PCI_COMMAND, cmd & ~(PCI_COMMAND_IO | PCI_COMMAND_MEMORY));
    for (int i = 0; i < 6; i++) {
        u8 off = (u8)(PCI_BAR0 + 4 * i);
        u32 orig = pci_cfg_read32(d, off);
        pci_cfg_write32(d, off, 0xffffffffu);
        u32 probe = pci_cfg_read32(d, off);
        pci_cfg_write32(d, off, orig);
        if (!probe)
            continue;           /* unimplemented BAR */
        struct pci_bar *b = &d->bar[i];
        if (orig & 1) {
            u32 mask = probe & ~3u & 0xffff;
            if (!mask)
                continue;
            b->io = 1;
            b->size = (u64)((~mask + 1) & 0xffff);
            b->addr = orig & ~3u;
        } else {
            u64 mask = probe & ~0xfull;
            u64 addr = orig & ~0xfull;
            if (((orig >> 1) & 3) == 2 && i < 5) {
                u8 off_hi = (u8)(off + 4);
                u32 orig_hi = pci_cfg_read32(d, off_hi);
                pci_cfg_write32(d, off_hi, 0xffffffffu);
                u32 probe_hi = pci_cfg_read32(d, off_hi);
                pci_cfg_write32(d, off_hi, orig_hi);
                mask |= (u64)probe_hi << 32;
                addr |= (u64)orig_hi << 32;
                b->is64 = 1;
            } else {
                mask |= 0xffffffff00000000ull;
            }
            if (!(mask & 0xffffffffull) && !b->is64)
                continue;
            b->size = ~mask + 1;
            b->addr = addr;
        }
        if (!b->size)
            continue;
        if (!b->addr) {
            if (b->io) {
                u64 a = align_up(io_next, b->size);
                if (a + b->size <= IO_WINDOW_END) {
                    b->addr = a;
                    io_next = a + b->size;
                    pci_cfg_write32(d, off, (u32)a | 1);
                }
            } else {
                u64 a = align_up(mmio_next, b->size);
                if (a + b->size <= MMIO32_WINDOW_END) {
                    b->addr = a;
                    mmio_next = a + b->size;
                    pci_cfg_write32(d, off, (u32)a | (orig & 0xf));
                    if (b->is64)
                        pci_cfg_write32(d, (u8)(off + 4), 0);
                }
            }
        }
        if (b->is64)
            i++;
    }
    pci_cfg_write32(d, PCI_COMMAND, cmd | PCI_COMMAND_IO | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
}

void pci_scan(void)
{
    pci_ndevs = 0;
    for (u8 dev = 0; dev < 32; dev++) {
        for (u8 fn = 0; fn < 8; fn++) {
            u32 id = cfg_read(0, dev, fn, 0);
            if ((id & 0xffff) == 0xffff) {
                if (fn == 0)
                    break;
                continue;
            }
            if (pci_ndevs < PCI_MAX_DEVS) {
                struct pci_dev *d = &pci_devs[pci_ndevs++];
                memset(d, 0, sizeof(*d));
                d->bus = 0;
                d->dev = dev;
                d->fn = fn;
                d->vendor = (u16)id;
                d->device = (u16)(id >> 16);
                d->class_rev = cfg_read(0, dev, fn, 0x08);
                /* Only header type 0 has six BARs. */
                if (((cfg_read(0, dev, fn, PCI_HEADER_TYPE & 0xfc) >> 16) & 0x7f) == 0)
                    size_bars(d);
            }
            if (fn == 0 && !((cfg_read(0, dev, 0, PCI_HEADER_TYPE & 0xfc) >> 16) & 0x80))
                break;
        }
    }
    for (int i = 0; i < pci_ndevs; i++) {
        struct pci_dev *d = &pci_devs[i];
        printf("@pci bdf=%02x:%02x.%u id=%04x:%04x class=%06x", d->bus, d->dev, d->fn, d->vendor,
               d->device, d->class_rev >> 8);
        for (int b = 0; b < 6; b++)
            if (d->bar[b].size)
                printf(" bar%d=%s:0x%lx:%lu", b, d->bar[b].io ? "io" : (d->bar[b].is64 ? "mem64" : "mem32"),
                       d->bar[b].addr, d->bar[b].size);
        printf("\n");
    }
}

struct pci_dev *pci_find(u16 vendor, u16 device)
{
    for (int i = 0; i < pci_ndevs; i++)
        if (pci_devs[i].vendor == vendor && pci_devs[i].device == device)
            return &pci_devs[i];
    return NULL;
}
