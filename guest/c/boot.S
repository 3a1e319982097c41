/*
 * iopath guest boot stub.
 *
 * Entered in 32-bit protected mode with paging off, the state the Multiboot
 * (v1) specification defines: EAX = 0x2BADB002, EBX = physical address of the
 * multiboot information structure. QEMU's `-kernel` loader and the iopath VMM
 * both start the image this way.
 *
 * The stub runs at CPL0, where this host's KVM emulates every instruction
 * (~1 us each), so it does as little as it can: page tables, GDT and TSS are
 * static data; it enables long mode, fills the IDT, loads the TSS (whose
 * all-zero I/O permission bitmap lets ring 3 use port I/O), and drops to
 * ring 3 with IRETQ. Everything else runs at CPL3.
 */

#define MB_MAGIC 0x1BADB002
#define MB_FLAGS 0x00000002          /* bit 1: ask for memory information */

#define SEL_KCODE64 0x08
#define SEL_KDATA   0x10
#define SEL_KCODE32 0x18
#define SEL_UDATA   0x20
#define SEL_UCODE64 0x28
#define SEL_TSS     0x30

#define RING0_MAGIC 0x52304741     /* "AG0R": see ring0_gate */
#define TSS_LIMIT   (104 + 8192 + 1 - 1)

        /* DS, ES, SS, FS, GS <- the kernel data selector (same encoding in both modes). */
        .macro LOAD_DATA_SEGMENTS
        movw $SEL_KDATA, %ax
        movw %ax, %ds
        movw %ax, %es
        movw %ax, %ss
        movw %ax, %fs
        movw %ax, %gs
        .endm

        .section .multiboot, "a"
        .align 4
        .long MB_MAGIC
        .long MB_FLAGS
        .long -(MB_MAGIC + MB_FLAGS)

        .section .text.boot, "ax"
        .code32
        .globl _start
_start:
        cli
        movl %eax, mb_magic
        movl %ebx, mb_info
        lgdt gdt_desc32
        ljmp $SEL_KCODE32, $1f
1:
        LOAD_DATA_SEGMENTS
        movl %cr4, %eax
        orl $0x20, %eax                /* PAE */
        movl %eax, %cr4
        movl $pml4, %eax
        movl %eax, %cr3
        movl $0xC0000080, %ecx         /* EFER */
        rdmsr
        orl $0x100, %eax               /* LME */
        wrmsr
        movl %cr0, %eax
        orl $0x80000001, %eax          /* PG | PE */
        movl %eax, %cr0
        ljmp $SEL_KCODE64, $long_entry

        .code64
long_entry:
        LOAD_DATA_SEGMENTS
        movq $kstack_top, %rsp

        /* 64-bit TSS descriptor: the base is a link-time address, split here. */
        movl $tss, %eax
        movl %eax, %edx
        andl $0xFFFFFF, %edx
        shlq $16, %rdx
        movl %eax, %ecx
        shrl $24, %ecx
        shlq $56, %rcx
        orq %rcx, %rdx
        orq $TSS_LIMIT, %rdx
        movabsq $0x0000890000000000, %rcx
        orq %rcx, %rdx
        movq %rdx, gdt + SEL_TSS
        movq $0, gdt + SEL_TSS + 8
        movw $SEL_TSS, %ax
        ltr %ax

        /* IDT: vectors 0..31, interrupt gates to the stubs in isr_table;
           32..255 (external interrupts: MSI-X) to isr_irq. */
        leaq idt(%rip), %rdi
        leaq isr_table(%rip), %rsi
        xorl %ecx, %ecx
2:
        leaq isr_irq(%rip), %rax
        cmpl $32, %ecx
        jae 6f
        movq (%rsi,%rcx,8), %rax       /* handler address (< 4 GiB) */
6:
        movq %rax, %rdx
        andq $0xFFFF, %rdx             /* offset 15:0 */
        orq $(SEL_KCODE64 << 16), %rdx
        movabsq $0x00008E0000000000, %r8
        orq %r8, %rdx                  /* present, DPL0, 64-bit interrupt gate */
        movq %rax, %r8
        shrq $16, %r8
        andq $0xFFFF, %r8
        shlq $48, %r8
        orq %r8, %rdx
        movq %rdx, (%rdi)
        movq $0, 8(%rdi)
        addq $16, %rdi
        incl %ecx
        cmpl $256, %ecx
        jne 2b
        lidt idt_desc(%rip)

        /* Drop to ring 3: SS, RSP, RFLAGS (IF=0, IOPL=0), CS, RIP. */
        pushq $(SEL_UDATA | 3)
        pushq $ustack_top
        pushq $0x2
        pushq $(SEL_UCODE64 | 3)
        pushq $user_entry
        iretq

        .globl user_entry
user_entry:
        movl mb_info(%rip), %edi
        movl mb_magic(%rip), %esi
        call guest_main
        /* guest_main returns an exit code; leave through isa-debug-exit. */
        movl %eax, %edi
        call guest_exit
3:      jmp 3b

/*
 * ring0_call from ring 3 (a ud2 with RAX = RING0_MAGIC, RDI = function,
 * RSI = argument): call RDI(RSI) at CPL0 on the TSS.RSP0 stack and return
 * to the instruction after the ud2 with its RAX. A #UD is the gate because
 * this host's KVM delivers ring-3 faults to the CPL0 handler but answers a
 * ring-3 `int $0x80` through a DPL3 gate with #UD itself. The caller
 * declares every register the C calling convention lets the callee clobber.
 */
ring0_gate:
        addq $2, (%rsp)                /* saved RIP: past the ud2 */
        pushq %rbp
        movq %rsp, %rbp
        andq $-16, %rsp
        movq %rdi, %rax
        movq %rsi, %rdi
        call *%rax
        movq %rbp, %rsp
        popq %rbp
        iretq

/*
 * Exception stubs. A fault while probe_skip != 0 is a probe (for example
 * "does vmcall raise #UD here?"): record the vector, skip probe_skip bytes of
 * the faulting instruction and return. Any other fault goes to the C handler,
 * which prints the vector, error code and RIP and exits through port 0xf4.
 */
        .macro ISR_NOERR n
isr_\n:
        pushq $0
        pushq $\n
        jmp isr_common
        .endm
        .macro ISR_ERR n
isr_\n:
        pushq $\n
        jmp isr_common
        .endm

        ISR_NOERR 0
        ISR_NOERR 1
        ISR_NOERR 2
        ISR_NOERR 3
        ISR_NOERR 4
        ISR_NOERR 5
isr_6:
        /* ud2 with RAX = RING0_MAGIC is ring0_call (guest.h), not a fault. */
        cmpq $RING0_MAGIC, %rax
        je ring0_gate
        pushq $0
        pushq $6
        jmp isr_common
        ISR_NOERR 7
        ISR_ERR   8
        ISR_NOERR 9
        ISR_ERR   10
        ISR_ERR   11
        ISR_ERR   12
        ISR_ERR   13
        ISR_ERR   14
        ISR_NOERR 15
        ISR_NOERR 16
        ISR_ERR   17
        ISR_NOERR 18
        ISR_NOERR 19
        ISR_NOERR 20
        ISR_ERR   21
        ISR_NOERR 22
        ISR_NOERR 23
        ISR_NOERR 24
        ISR_NOERR 25
        ISR_NOERR 26
        ISR_NOERR 27
        ISR_NOERR 28
        ISR_ERR   29
        ISR_ERR   30
        ISR_NOERR 31

/*
 * An external interrupt (an MSI-X message of a device's queue): counted, and
 * ended with an EOI to the local APIC (xAPIC page, identity-mapped). Taken
 * only where a workload waits with interrupts enabled (irq_wait in nvme.c);
 * ring 3 runs with IF=0, so a message that comes while it polls stays
 * pending until then.
 */
isr_irq:
        pushq %rax
        incq irq_count(%rip)
        movl $0xfee000b0, %eax
        movl $0, (%rax)
        popq %rax
        iretq

isr_common:
        pushq %rax
        movq probe_skip(%rip), %rax
        testq %rax, %rax
        jz 4f
        addq %rax, 24(%rsp)            /* saved RIP: rax, vector, error, RIP */
        movq 8(%rsp), %rax
        orq $0x100, %rax
        movq %rax, probe_fault(%rip)
        movq $0, probe_skip(%rip)
        popq %rax
        addq $16, %rsp
        iretq
4:
        pushq %rcx
        pushq %rdx
        pushq %rsi
        pushq %rdi
        pushq %r8
        pushq %r9
        pushq %r10
        pushq %r11
        movq %rsp, %rdi
        andq $-16, %rsp
        call fault_handler
5:      jmp 5b

        .section .rodata
        .align 8
isr_table:
        .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
        .quad isr_\n
        .endr

        .section .data
        .align 16
gdt:
        .quad 0
        .quad 0x00AF9A000000FFFF       /* 0x08 kernel code, 64-bit */
        .quad 0x00CF92000000FFFF       /* 0x10 kernel data */
        .quad 0x00CF9A000000FFFF       /* 0x18 kernel code, 32-bit */
        .quad 0x00CFF2000000FFFF       /* 0x20 user data, DPL3 */
        .quad 0x00AFFA000000FFFF       /* 0x28 user code, 64-bit, DPL3 */
        .quad 0, 0                     /* 0x30 TSS, filled at boot */
gdt_end:
gdt_desc32:
        .word gdt_end - gdt - 1
        .long gdt
        .align 16
idt_desc:
        .word 256 * 16 - 1
        .quad idt

        .globl mb_magic, mb_info, probe_skip, probe_fault, irq_count
        .align 8
irq_count:   .quad 0
mb_magic:    .quad 0
mb_info:     .quad 0
probe_skip:  .quad 0
probe_fault: .quad 0

        /* TSS with an all-zero I/O permission bitmap: ring 3 may use every port. */
        .align 16
tss:
        .long 0
        .quad kstack_top               /* RSP0 */
        .quad 0, 0                     /* RSP1, RSP2 */
        .quad 0
        .quad 0, 0, 0, 0, 0, 0, 0      /* IST1..7 */
        .quad 0
        .word 0
        .word 104                      /* I/O map base */
        .fill 8192, 1, 0
        .byte 0xff

        /* Identity map of the low 4 GiB with 2 MiB pages, user-accessible. */
        .align 4096
pml4:
        .quad pdpt + 0x7
        .fill 511, 8, 0
pdpt:
        .quad pd + 0x7
        .quad pd + 0x1000 + 0x7
        .quad pd + 0x2000 + 0x7
        .quad pd + 0x3000 + 0x7
        .fill 508, 8, 0
pd:
        .set addr, 0
        .rept 2048
        .quad addr + 0x87
        .set addr, addr + 0x200000
        .endr

        .section .bss
        .align 4096
idt:    .space 256 * 16
        .align 16
        .space 16384
kstack_top:
        .space 65536
        .globl ustack_top
ustack_top:
