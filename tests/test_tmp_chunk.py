from tests.test_hardening_http import *
def test_x(server_factory):
    server = server_factory("--max-body-bytes", "4096")
    with tls_connection(server) as conn:
        chunk = b"x" * 3000
        conn.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3)
        print(read_answer(conn))
