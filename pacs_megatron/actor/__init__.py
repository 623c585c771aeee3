"""actor"""
