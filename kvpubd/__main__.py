from kvpubd.cli import main

main()
