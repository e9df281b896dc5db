from mtp_mask_fix.cli import main


main()
