from xpuctl.cli import main

main()
