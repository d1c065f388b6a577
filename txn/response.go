package txn

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// Response is an operation's terminal result. It is stored with the last
// phase's writes and replayed byte for byte to every retry.
type Response struct {
	// Status is an HTTP status code, 100 to 599. 4xx and 5xx responses that
	// the operation returns are terminal too: they are stored and replayed,
	// except the client-correctable rejections Config.Store does not store
	// when they come before anything took effect.
	Status int
	// Header holds the headers to store and replay (e.g. Content-Type, Location).
	Header http.Header
	// Body is the response body, replayed byte for byte.
	Body []byte
	// Replayed is true when the response was read from storage rather than
	// produced by this call.
	Replayed bool
}

// JSON returns a Response with status, v encoded as JSON, and a
// Content-Type of application/json.
func JSON(status int, v any) (Response, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return Response{}, fmt.Errorf("txn: encode response: %w", err)
	}
	return Response{
		Status: status,
		Header: http.Header{"Content-Type": []string{"application/json"}},
		Body:   body,
	}, nil
}

func (r Response) validate() error {
	if r.Status < 100 || r.Status > 599 {
		return fmt.Errorf("%w: response status %d is not 100-599", ErrInvalidUse, r.Status)
	}
	return nil
}

func (r Response) encodedHeader() ([]byte, error) {
	if len(r.Header) == 0 {
		return []byte("{}"), nil
	}
	b, err := json.Marshal(r.Header)
	if err != nil {
		return nil, fmt.Errorf("%w: response header: %w", ErrInvalidUse, err)
	}
	return b, nil
}

func storedResponse(status int32, header, body []byte) (Response, error) {
	resp := Response{Status: int(status), Body: body, Replayed: true}
	if resp.Body == nil {
		resp.Body = []byte{}
	}
	if len(header) > 0 && string(header) != "{}" {
		if err := json.Unmarshal(header, &resp.Header); err != nil {
			return Response{}, fmt.Errorf("decode stored header: %w", err)
		}
	}
	return resp, nil
}
